"""The extra state written and read from one table (layers/checkpoint.py), and loads told apart without frame
inspection (issue 73).

``fixtures/baseline_checkpoints.pt`` holds state dicts saved by whitenlayers 683b06b (the code before the table:
``fixtures/baseline_checkpoints.py`` wrote them): the extra state's layouts 2 (the block), 3 (a pending fold) and
4 (``fold_async``'s slot, empty and holding a fold), for grad, recursive and direct layers, a grouped conv among
them. Each loads into the same model built now, and saves back bit for bit.
"""
import pathlib
import sys

import pytest
import torch

import whitenlayers as wl
from whitenlayers.layers import checkpoint as ckpt

sys.path.insert(0, str(pathlib.Path(__file__).parent / "fixtures"))
from baseline_checkpoints import CASES, build, make_standalone, train  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "baseline_checkpoints.pt"
PACKAGE = pathlib.Path(wl.__file__).parent


@pytest.fixture(scope="module")
def saved():
    return torch.load(FIXTURES, weights_only=True)


def _fresh(name):
    method, fold_async, standalone, _ = CASES[name]
    net = build(method, fold_async)
    if standalone:
        make_standalone(net)
    return net


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_of_the_baseline_loads_and_saves_back_bit_for_bit(saved, name):
    state = saved[name]
    net = _fresh(name)
    net.load_state_dict(state)
    again = net.state_dict()
    assert again.keys() == state.keys()
    for key, value in state.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key


def test_the_fixtures_hold_every_layout_and_a_pending_fold(saved):
    layouts = {int(v[0]) for sd in saved.values() for k, v in sd.items() if k.endswith("_extra_state")}
    assert layouts == {2, 3, 4}
    _, layer = wl.whitening_layers(_loaded(saved, "grad-async-pending"))[0]
    assert layer._pending_fold is not None and layer._pending_fold.outcome.status == wl.fold.FOLDED
    _, layer = wl.whitening_layers(_loaded(saved, "grad-async-slot-empty"))[0]
    assert layer._pending_fold is None


def _loaded(saved, name):
    net = _fresh(name)
    net.load_state_dict(saved[name])
    return net


@pytest.mark.parametrize("name", ["grad-mid-block", "recursive-async-pending", "grad-pending-standalone"])
def test_a_baseline_checkpoint_resumes_as_the_run_it_was_saved_from(saved, name):
    """Loaded mid-block (a pending fold too), the model trains on as the run it was saved from: the same run
    trained further without a checkpoint between."""
    method, fold_async, standalone, steps = CASES[name]
    whole = build(method, fold_async)
    train(whole, steps)
    if standalone:
        make_standalone(whole)
    resumed = _loaded(saved, name)
    for net in (whole, resumed):
        torch.manual_seed(2)
        train(net, 4)
    for (key, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("table", [ckpt._block_table(3, (1, 3, 3)), ckpt._pending_table(3, [("running_cov", (3, 3))])])
def test_the_table_reads_back_what_it_writes(table):
    values = {entry.name: (torch.randn(entry.shape, dtype=torch.float64) if entry.shape else
                           {torch.bool: True, torch.int64: 7, torch.float64: 2.5}[entry.dtype]) for entry in table}
    packed = ckpt._write(table, values, "cpu")
    assert packed.shape == (ckpt._numel(table),) and packed.dtype == torch.float64
    back = ckpt._read(table, packed)
    for entry in table:
        if entry.shape:
            assert torch.equal(back[entry.name], values[entry.name]), entry.name
        else:
            assert back[entry.name] == values[entry.name] and type(back[entry.name]) is type(values[entry.name])


def test_no_frame_inspection_in_the_package():
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "_getframe" in p.read_text()]
    assert users == []


def test_positional_records_in_checkpoint_py_stay_few():
    """Subscripts of a plain name by an integer constant (13 before the table, issue 73)."""
    import ast

    tree = ast.parse((PACKAGE / "layers" / "checkpoint.py").read_text())
    hits = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int)]
    assert len(hits) <= 2, hits
