"""Issue 74, round five: a hook added after conversion, the direct model's plain checkpoint, exit with a fold in
flight."""
import copy
import re

import pytest
import torch
from torch import nn

import whitenlayers as wl
from whitenlayers import models

F64 = torch.float64


def cifar_resnet(seed):
    torch.manual_seed(seed)
    return models.cifar_resnet(8, width=4).to(F64)


def train_steps(model, steps, seed=1):
    """A few SGD steps on correlated, offset data (float64)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        base = torch.randn(8, 1, 16, 16, generator=g, dtype=F64)
        x = base + 0.3 * torch.randn(8, 3, 16, 16, generator=g, dtype=F64) + 2.0
        y = torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def inputs(seed=5):
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=F64) + 2.0


# --------------------------------------------------------------------------
# The direct model's plain checkpoint: what plain_state_dict's error message says to do
# --------------------------------------------------------------------------
def test_the_direct_plain_checkpoint_loads_back_as_the_message_says():
    model = wl.convert_model(cifar_resnet(0), method="direct", block_size=1)
    train_steps(model, 3)
    model.eval()
    x = inputs()
    want = model(x)
    with pytest.raises(ValueError, match="padded direct conv") as err:
        wl.plain_state_dict(model)
    message = str(err.value)
    assert "plain_state_dict(model, strict=False)" in message and "wl.load_plain_state_dict" in message
    sd = wl.plain_state_dict(model, strict=False)
    assert any(re.search(r"\.conv1\.0\.weight$", k) for k in sd)  # the padded 3x3 convs' 1x1 whitening convs
    other = wl.convert_model(cifar_resnet(1), method="direct")
    assert wl.load_plain_state_dict(other, sd) == ([], [])
    # T (x - mu) with mu = -T^-1 b from the 1x1 conv's bias (a float64 solve): the measured gap is ~1e-15
    torch.testing.assert_close(other.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)
    # and the export of the loaded model is the checkpoint's function again
    again = wl.plain_state_dict(other, strict=False)
    assert set(again) == set(sd)
    exported = wl.to_plain_model(copy.deepcopy(other))
    torch.testing.assert_close(exported.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)
    # training goes on from there: the next fold takes the new statistics
    train_steps(other, 2)
    assert all(torch.isfinite(p).all() for p in other.parameters())


# --------------------------------------------------------------------------
# A forward hook registered on a converted layer after convert_model
# --------------------------------------------------------------------------
def scale_output(module, args, output):
    return output * 1.5


def absorbed_layers(model):
    return {n for n, m in wl.whitening_layers(model) if m.centring == "absorbed"}


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_a_hook_added_after_conversion_exports_what_the_model_computes(method):
    model = wl.convert_model(cifar_resnet(0), method=method, block_size=2)
    train_steps(model, 3)  # absorbed offsets d != 0
    layer = model.layer1[0].conv1
    assert layer.centring == "absorbed"
    layer.register_forward_hook(scale_output)
    with pytest.warns(UserWarning, match=r"layer1\.0\.conv1.*scale_output.*centres its input again"):
        train_steps(model, 3, seed=2)
    assert layer.centring == "input" and "layer1.0.conv1" not in absorbed_layers(model)
    model.eval()
    x = inputs()
    want = model(x)
    exported = wl.to_plain_model(copy.deepcopy(model))
    # the same function through another bias path (measured gap ~1e-15; 5.5e-3 when the offset went into the
    # BatchNorm's running mean without the hook's effect)
    torch.testing.assert_close(exported.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)
    with pytest.raises(ValueError, match=r"'layer1\.0\.conv1'.*bias-free layer that centres its input"):
        wl.plain_state_dict(model)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_a_hook_added_before_any_forward_is_seen_at_export(method):
    """No forward since the hook was added: the export and plain_state_dict see it themselves."""
    model = wl.convert_model(cifar_resnet(0), method=method, block_size=2)
    train_steps(model, 3)
    model.eval()
    layer = model.layer2[0].conv2
    layer.register_forward_hook(scale_output)
    x = inputs()
    with pytest.raises(ValueError, match=r"'layer2\.0\.conv2'.*forward hook.*scale_output.*registered after"):
        wl.plain_state_dict(model)
    assert layer.centring == "absorbed"  # plain_state_dict leaves the model alone
    with pytest.warns(UserWarning, match="scale_output"):
        exported = wl.to_plain_model(copy.deepcopy(model))
    with pytest.warns(UserWarning, match="scale_output"):
        want = model(x)  # (the model's own forward centres the layer's input again)
    torch.testing.assert_close(exported.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_a_hook_added_after_conversion_trains_as_one_added_before(method):
    """Handled as at conversion: a layer with a forward hook is left centring its input."""
    def nonlinear(module, args, output):
        return torch.tanh(output)

    before = cifar_resnet(0)
    before.layer1[0].conv2.register_forward_hook(nonlinear)
    before = wl.convert_model(before, method=method, block_size=2)
    after = wl.convert_model(cifar_resnet(0), method=method, block_size=2)
    assert "layer1.0.conv2" in absorbed_layers(after) - absorbed_layers(before)
    after.layer1[0].conv2.register_forward_hook(nonlinear)
    with pytest.warns(UserWarning, match="nonlinear"):
        train_steps(after, 5)
    train_steps(before, 5)
    assert absorbed_layers(after) == absorbed_layers(before)
    for (name, a), b in zip(after.state_dict().items(), before.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------
# Join([ddp]) without wl.joinable(ddp)
# --------------------------------------------------------------------------
def _join_without_joinable(rank, world):
    """``Join([ddp])`` alone, rank 1 four batches short: what each rank meets, and at which step."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = wl.convert_model(models.cifar_resnet(8, width=4, num_classes=4).double(), "grad", block_size=3)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    done = 0  # steps done
    try:
        with Join([ddp]):
            for _ in range(10 - 4 * rank):  # rank 0 folds at its 9th batch, after rank 1 has joined
                x = torch.randn(4, 3, 8, 8, generator=gen, dtype=F64) + 1
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), torch.randint(0, 4, (4,), generator=gen)).backward()
                opt.step()
                done += 1
    except RuntimeError as exc:
        return done, str(exc)
    return done, ""


@pytest.mark.slow
def test_join_without_the_whitening_joinable_fails_at_once_on_every_rank():
    from dist_utils import run_distributed

    for done, message in run_distributed(_join_without_joinable):
        assert done == 0 and "Join([ddp_model, wl.joinable(ddp_model)])" in message, (done, message[:300])


# --------------------------------------------------------------------------
# Exit with fold_async=True and a fold in flight
# --------------------------------------------------------------------------
EXIT_SCRIPT = """
import sys
import torch
from torch import nn
import whitenlayers as wl

def trained(width):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(2)]).double()
    model = wl.convert_model(net, method="grad", targets="all", include_linear=True, include_stem=True,
                             include_classifier=True, fold_async=True, block_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the third batch ends the block: its fold starts in the worker
        opt.zero_grad()
        model(torch.randn(16, width, generator=g, dtype=torch.float64) + 1).square().mean().backward()
        opt.step()
    return model

if __name__ == "__main__":
    model = trained(int(sys.argv[1]))
    if len(sys.argv) > 2:
        torch.save(model.state_dict(), sys.argv[2])  # a checkpoint before exit: it waits for the fold
"""


@pytest.mark.slow
def test_exit_with_a_fold_in_flight_is_clean_and_a_checkpoint_before_it_keeps_the_fold(tmp_path):
    """An exiting process with a fold in flight exits with code 0 and nothing on stderr (the worker is joined,
    never abandoned: a daemon worker's torch op returning during interpreter finalization aborts the process,
    'terminate called without an active exception'); a checkpoint saved before exit holds the fold's result."""
    import subprocess
    import sys

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    env = {**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(wl.__file__).parents[1])}
    ckpt = tmp_path / "state.pt"
    for args in ([], [str(ckpt)]):
        run = subprocess.run([sys.executable, str(script), "512", *args], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
    sys.path.insert(0, str(tmp_path))
    try:
        import exit_script
    finally:
        sys.path.remove(str(tmp_path))
    model = exit_script.trained(512)
    want = model.state_dict()  # (waits for the fold, in this process)
    saved = torch.load(ckpt, weights_only=False)
    assert saved.keys() == want.keys()
    assert any(k.endswith("num_blocks") for k in want)
    for key, value in want.items():  # the same code path: bit-identical
        assert torch.equal(saved[key], value), key


MID_FOLD_EXIT_SCRIPT = """
import atexit, sys
import torch
from torch import nn
import whitenlayers as wl
from whitenlayers import coordinator

calls = []
compute = coordinator._compute_folds

def held_first_part(layers, *args, **kwargs):  # an eigendecomposition still running when the process exits
    calls.append(len(layers))
    if len(calls) == 1:
        assert coordinator._EXITING.wait(120), "the exit never cancelled the fold"
    return compute(layers, *args, **kwargs)

coordinator._compute_folds = held_first_part
atexit.register(lambda: print(calls, flush=True))  # runs after the worker is joined
torch.manual_seed(0)
net = nn.Sequential(*[nn.Linear(i, o) for i, o in ((8, 8), (8, 16), (16, 16), (16, 32), (32, 32))])
model = wl.convert_model(net, method="grad", targets="all", include_linear=True, include_stem=True,
                         include_classifier=True, fold_async=True, block_size=2)
for _ in range(2):
    model(torch.randn(4, 8)).sum().backward()
sys.exit(3)
"""


@pytest.mark.slow
def test_an_exit_stops_a_fold_in_flight_after_the_part_in_progress(tmp_path):
    """The interpreter's exit, with the worker inside the first part of a three-part fold (held there until the exit
    begins, as a long eigendecomposition would be): the worker is joined after that part and starts no other; the
    script's exit code and a clean stderr survive."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "mid_fold_exit.py"
    script.write_text(MID_FOLD_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(wl.__file__).parents[1])}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 3 and run.stderr == "", run.stderr[-2000:]
    assert run.stdout.strip() == "[2]", run.stdout  # the first stack (two 8-wide layers) only, of three
