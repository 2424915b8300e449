"""The host-sync meter (raymoe.rank.host_syncs): what it counts, what it lets pass, and where it says it happened."""

import torch

from raymoe.rank.host_syncs import HostSyncs


def test_every_kind_of_wait_is_counted_at_its_site():
    x = torch.arange(6.0)
    with HostSyncs() as syncs:
        x.sum().item()
        bool(x[0])
        int(x[1])
        x.tolist()
        x.cpu()
        x.to("cpu")
        x[x > 2]
        torch.nonzero(x)
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 0, 1]))
        x.unique()
    assert syncs.count == 10, syncs.sites
    assert all(site.startswith("outside raymoe") for site in syncs.sites), syncs.sites  # called from a test


def test_what_does_not_wait_is_not_counted():
    x = torch.arange(6.0)
    counts = torch.tensor([1, 0, 2, 1, 0, 1])
    with HostSyncs() as syncs:
        y = (x * 2).softmax(0)
        x.to(torch.float64)  # a dtype, no device
        x.to("cpu", non_blocking=True)
        torch.repeat_interleave(x, counts, output_size=5)  # the size given: nothing to read
        host = y.cpu()  # one wait ...
        float(host[0]), host.tolist()  # ... then reading the host copy is free
    assert syncs.count == 1, syncs.sites


def test_a_site_in_raymoe_is_named_by_file_and_line():
    from raymoe.parallel.grad_norm import clip_grads

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    with HostSyncs() as syncs:
        clip_grads([param], torch.tensor(10.0), 1.0)  # scales on the device: no wait
        torch.tensor(3.0).to("cpu").item()
    assert syncs.count == 1 and not any("grad_norm" in site for site in syncs.sites), syncs.sites
