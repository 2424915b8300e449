"""Asking real Ray nodes whether they see the driver's local paths (actors.shared_paths): a zero-CPU task pinned to
each node that hosts ranks and is not the driver's. On this one-node cluster the driver's node is named as another
one so that its node is asked (the several-node run of tests/actors/test_multinode.py asks real other nodes)."""

from __future__ import annotations

import pytest

from actors.shared_paths import check_nodes_see
from raymoe.spec.shared_paths import read_path

NOT_THIS_NODE = "f" * 56


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 32)
    return tmp_path


def test_a_node_that_sees_the_files_passes(ray_session, checkpoint):
    node = ray_session.get_runtime_context().get_node_id()
    check_nodes_see([read_path("from_pretrained path", checkpoint)], [node, node], driver_node=NOT_THIS_NODE)


def test_a_node_that_does_not_see_a_file_is_one_error_naming_it(ray_session, checkpoint):
    node = ray_session.get_runtime_context().get_node_id()
    need = read_path("from_pretrained path", checkpoint)
    (checkpoint / "model.safetensors").unlink()  # what the driver listed is gone from the node's view
    with pytest.raises(ValueError, match=r"node .* \(ranks 0\.\.1\) does not see it") as error:
        check_nodes_see([need], [node, node], driver_node=NOT_THIS_NODE)
    assert f"{checkpoint}/model.safetensors is missing" in str(error.value)


def test_ranks_on_the_drivers_node_are_not_asked(ray_session, checkpoint):
    node = ray_session.get_runtime_context().get_node_id()
    need = read_path("from_pretrained path", checkpoint)
    (checkpoint / "config.json").unlink()
    check_nodes_see([need], [node, node])  # the driver's own node sees what the driver sees: nothing runs
