"""metrics.jsonl and the metrics plot."""

from raymoe.driver.metrics import MetricsLog, plot_metrics, read_metrics


def test_metrics_jsonl_and_plot(tmp_path):
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    log.append({"step": 0, "eval_loss": 5.5})
    for step in range(1, 6):
        log.append({"step": step, "loss": 5.0 - step, "tokens_per_s": 100.0 * step, "max_expert_imbalance": 1.5})
    assert read_metrics(log.path) == log.records and len(log.records) == 6
    png = plot_metrics(log.records, tmp_path / "run" / "metrics.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # a new run starts a fresh file
    assert MetricsLog(log.path).records == [] and log.path.read_text() == ""
