"""The rule of local paths in a world that spans machines (raymoe.spec.shared_paths): what the driver lists, what a
node reports, and the one error."""

from __future__ import annotations

import pytest

from raymoe.spec.shared_paths import (
    MARKER_PREFIX,
    check_seen,
    launch_reads,
    problems_on_node,
    read_path,
    remove_marker,
    write_path,
)


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "x"}')
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    (directory / "README.md").write_text("not read by the ranks")
    (directory / "sub").mkdir()
    (directory / "sub" / "deep.bin").write_bytes(b"12")
    return directory


def test_read_path_lists_the_checkpoint_files_with_their_sizes(checkpoint):
    need = read_path("from_pretrained path", checkpoint)
    assert need.path == str(checkpoint)
    assert need.files == (("config.json", 19), ("model.safetensors", 64))
    every = read_path("load_state path", checkpoint, every_file=True)
    assert {name for name, _ in every.files} == {"config.json", "model.safetensors", "README.md", "sub/deep.bin"}


def test_a_node_that_sees_the_same_files_reports_nothing(checkpoint):
    assert problems_on_node([read_path("from_pretrained path", checkpoint)]) == []


def test_a_missing_file_and_a_file_of_another_size_are_reported(checkpoint):
    need = read_path("from_pretrained path", checkpoint)
    (checkpoint / "config.json").unlink()
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 10)
    assert problems_on_node([need]) == [
        f"from_pretrained path {checkpoint}/config.json is missing",
        f"from_pretrained path {checkpoint}/model.safetensors is 10 bytes there, 64 on the driver",
    ]


def test_a_write_path_is_created_with_a_marker_that_is_removed_after(tmp_path):
    target = tmp_path / "runs" / "a"
    need = write_path("output_dir", target)
    ((name, size),) = need.files
    assert name.startswith(MARKER_PREFIX) and size == 0 and (target / name).is_file()
    assert problems_on_node([need]) == []
    remove_marker(need)
    assert list(target.iterdir()) == []
    assert problems_on_node([need]) == [f"output_dir {target}/{name} is missing"]


def test_check_seen_passes_when_every_node_sees_it(checkpoint):
    need = read_path("from_pretrained path", checkpoint)
    check_seen([need], {"10.0.0.2": ([4, 5], []), "10.0.0.3": ([6, 7], [])})


def test_check_seen_names_the_path_the_nodes_and_their_ranks(checkpoint):
    need = read_path("from_pretrained path", checkpoint)
    problems = [f"from_pretrained path {checkpoint}/{name} is missing" for name in ("a", "b", "c", "d")]
    with pytest.raises(ValueError) as error:
        check_seen([need], {"10.0.0.2": ([4, 5, 6, 7], []), "10.0.0.3": ([8, 10], problems)})
    message = str(error.value)
    assert message.startswith(f"from_pretrained path={checkpoint} is a local path")
    assert "node 10.0.0.3 (ranks 8, 10) does not see it as the driver does" in message
    assert "(and 1 more)" in message and "10.0.0.2" not in message
    assert "storage URL" in message


def test_launch_reads_are_a_local_checkpoint_and_an_adapter(checkpoint, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert launch_reads("org/model", None) == ()  # a hub id: every node resolves it itself
    fields = [need.field for need in launch_reads(str(checkpoint), str(adapter))]
    assert fields == ["from_pretrained path", "lora adapter"]
