"""``torch.compile`` of a converted model: one graph for every step of a block, no recompilation (issue 32).

Dynamo's counters are the same whatever backend compiles the graphs, so these tests trace with ``aot_eager``
(dynamo and AOTAutograd, no code generation: seconds, not minutes). Inductor itself is exercised by
``tests/test_precision.py::test_compiled_*`` and by ``benchmarks/compile_step.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch.nn.functional as Fn
from torch._dynamo.utils import counters
from torch_versions import needs, recompile_limit

import whitenlayers as wl

# Dynamo traces of whole converted models, 2-6 CPU s each (measured at load 17 under -n 2): slow, so the README's
# command leaves them out; CI runs them with the slow tests and again with WHITENLAYERS_TEST_COMPILE=1 (.ci/run).
pytestmark = pytest.mark.slow

#: The graphs a converted model compiles to, as the plain model: one for every step, the very first included (its
#: batches are summed about the shift tensor's values, and moved to the shift they choose outside the graph); each
#: fold runs between two compiled forwards, in the coordinator's forward hook, outside the graphs. ``stats_every > 1``
#: adds one: the steps that gather nothing.
MAX_GRAPHS = 1


def _model(method: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    # widths 4, 8 and 16: three channel counts, each a different shape for every whitening buffer
    model = wl.models.cifar_resnet(8, width=4).double()
    return wl.convert_model(model, method, block_size=3, **kwargs)


def _train(model, steps: int, seed: int = 0, after_step=None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 0.5
        y = torch.randint(0, 10, (4,), generator=gen)
        opt.zero_grad()
        loss = Fn.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if after_step is not None:
            after_step()
    return torch.stack(losses)


def _assert_same_state(model, eager) -> None:
    """Compiled against eager, float64: they differ by the order of a few float64 sums (the compiled path always
    sums about a shift, eager may sum unshifted), ~1e-15 relative; 1e-9 leaves room for the steps. Counters
    exactly."""
    for (key, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=key)
        else:
            assert torch.equal(a, b), key


def _compiled_run(method: str, steps: int, **kwargs):
    torch._dynamo.reset()
    counters.clear()
    model = _model(method, **kwargs)
    compiled = torch.compile(model, backend="aot_eager")
    with recompile_limit(MAX_GRAPHS + 1):  # a step that recompiles past it runs eagerly
        losses = _train(compiled, steps)
    return model, losses


METHODS = ["grad", pytest.param("recursive", marks=pytest.mark.skipif(
    os.environ.get("WHITENLAYERS_TEST_COMPILE") != "1",
    reason="the traced forward is grad's (only the eager fold differs); WHITENLAYERS_TEST_COMPILE=1 runs it")),
    pytest.param("direct", marks=pytest.mark.skipif(
        os.environ.get("WHITENLAYERS_TEST_COMPILE") != "1", reason="WHITENLAYERS_TEST_COMPILE=1 runs it"))]


@pytest.mark.parametrize("method", METHODS)
def test_compiled_converted_model_has_one_graph_per_step_kind_and_trains_like_eager(method):
    steps = 7  # two whole blocks of 3 and one step of the third
    model, losses = _compiled_run(method, steps)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= MAX_GRAPHS, graphs  # not one graph per step of a block (the bug: 8, then eager)
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    layers = wl.whitening_layers(model)
    assert len({layer.num_features for _, layer in layers}) == 3
    assert all(int(layer.num_blocks) == 2 and layer.batches_in_block == 1 for _, layer in layers)
    # the compiled layers run in the graph: no eager scope is left open, and the traced calls were counted
    coordinator = next(h for h in model._forward_hooks.values() if isinstance(h, wl.coordinator.FoldCoordinator))
    assert not coordinator.scopes and not coordinator.traced_open
    eager = _model(method)
    eager_losses = _train(eager, steps)
    # float64 and the same statistics: compiled and eager differ by the order of a few float64 sums (the compiled
    # path always sums about a shift, eager may sum unshifted), ~1e-15 relative; 1e-9 leaves room for the steps
    torch.testing.assert_close(losses, eager_losses, rtol=1e-9, atol=1e-12)
    _assert_same_state(model, eager)


def test_compiled_stats_every_adds_one_graph_at_most():
    model, _ = _compiled_run("grad", 8, stats_every=2)
    assert counters["stats"]["unique_graphs"] <= MAX_GRAPHS + 1
    assert all(int(layer.num_blocks) == 2 for _, layer in wl.whitening_layers(model))


class _Twice(torch.nn.Module):
    """One conv called twice in a forward (a shared layer: weight tying, a recurrent cell, a consistency loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.relu(self.conv(x)))


def _twice(block_size: int, steps: int, backend=None):
    torch.manual_seed(0)
    model = wl.convert_model(_Twice(), "grad", predicate=lambda name, _: name == "conv", block_size=block_size)
    model = model.double()
    run = model if backend is None else torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        run(torch.randn(3, 4, 6, 6, generator=gen, dtype=torch.float64) + 1).sum().backward()
    return model.conv


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    os.environ.get("WHITENLAYERS_TEST_COMPILE") != "1", reason="code generation: WHITENLAYERS_TEST_COMPILE=1"))])
def test_compiled_layer_called_twice_per_forward_counts_like_eager(backend):
    """Each call is a batch with its own rows, as in eager mode (before: both calls' sums, one call's rows and
    one batch: running_cov 1.35-1.68x eager's)."""
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = _twice(2, 6, backend), _twice(2, 6)
    assert int(compiled.num_blocks) == int(eager.num_blocks) == 6
    assert counters["stats"]["unique_graphs"] <= MAX_GRAPHS
    for name in ("running_mean", "running_cov", "grad_transform"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=1e-9, atol=1e-12, msg=name)


def test_compiled_block_ending_between_two_calls_warns_and_keeps_the_calls_together():
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="called 2 times in one compiled forward"):
        layer = _twice(1, 3, "aot_eager")
    assert int(layer.num_blocks) == 3 and layer.batches_in_block == 0


def test_compiled_standalone_layer_breaks_the_graph_but_never_recompiles():
    """A layer without a coordinator (built alone) counts its batches outside the graph: graph breaks, no
    recompilation per step."""
    torch._dynamo.reset()
    counters.clear()
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=2, dtype=torch.float64)
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for _ in range(6):
        compiled(x).sum().backward()
    assert int(layer.num_blocks) == 3
    assert counters["stats"]["unique_graphs"] <= 4


@needs((2, 6), "AOTAutograd's static input indices (what CUDA graph trees read)")
@pytest.mark.parametrize("method", ["grad", "direct"])
def test_compiled_graphs_mutate_only_static_inputs(method):
    """What ``mode="reduce-overhead"`` needs on CUDA: every tensor a compiled training forward writes into (the
    block's accumulators, the absorbed offsets, BatchNorm's running statistics) is a static input of the graph, so
    that CUDA graph trees do not skip the graph for "mutated inputs" (their check, read off AOTAutograd's metadata
    here on a CPU)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen = []

    def forward_compiler(gm, example_inputs):
        meta = torch._guards.TracingContext.get().fw_metadata
        static = set(meta.static_input_indices)
        mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
        # the batch itself is an input that is not static: the static set is not simply every input
        assert len(static & set(range(len(example_inputs)))) < len(example_inputs)
        seen.append((mutated, [i for i in mutated if i not in static]))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model = _model(method)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_compiler))
    _train(compiled, 4)
    assert seen and all(mutated for mutated, _ in seen)  # the accumulators are written in the graph
    assert all(not non_static for _, non_static in seen), seen


def _fold_addresses(model, steps: int, compiled=None):
    """Train ``steps`` steps; after each, the data pointers of every whitening layer's forward buffers."""
    layers = [layer for _, layer in wl.whitening_layers(model)]
    seen = [{name: set() for name in layer._FORWARD_BUFFERS} for layer in layers]

    def record() -> None:
        for layer, addresses in zip(layers, seen):
            for name in addresses:
                addresses[name].add(layer._buffers[name].data_ptr())

    _train(compiled if compiled is not None else model, steps, after_step=record)
    return layers, seen


@pytest.mark.parametrize("method", ["grad", "direct"])
def test_compiled_layers_keep_their_forward_buffers_at_one_address(method):
    """Under torch.compile a fold writes every forward buffer in place, as in eager mode: CUDA graph trees
    (``mode="reduce-overhead"``), which read buffers at fixed addresses and record again when one moves, keep one
    recording over any number of blocks. The graph copies the buffers it reads (``whitenlayers::snapshot``), so a
    backward that runs after the fold (the block's last forward) keeps its forward's values: the training is
    eager's."""
    torch._dynamo.reset()
    model = _model(method)
    compiled = torch.compile(model, backend="aot_eager")
    layers, seen = _fold_addresses(model, 13, compiled)  # 4 folds
    assert all(int(layer.num_blocks) == 4 for layer in layers)
    assert all(len(addresses) == 1 for per_layer in seen for addresses in per_layer.values()), seen
    eager = _model(method)  # eager folds write in place: one address each
    _, eager_seen = _fold_addresses(eager, 13)
    assert all(len(addresses) == 1 for per_layer in eager_seen for addresses in per_layer.values()), eager_seen
    _assert_same_state(model, eager)


def test_a_compiled_backward_after_folds_keeps_its_forwards_buffers():
    """Two compiled forwards, a fold after each (block_size 1), then their backwards: each backward takes the
    Q_s of its own forward, though the buffers were written in place since (the partitioner saves the graph's
    snapshots instead of recomputing them from the buffers in the backward: the snapshot operator is marked
    side-effectful). Eager gives the same gradients, and the buffers keep their addresses."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 0.5 for _ in range(2)]
    grads = []
    for compile_ in (True, False):
        torch.manual_seed(0)
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4).double(), "grad", block_size=1)
        run = torch.compile(model, backend="aot_eager") if compile_ else model
        _train(run, 2)  # past the first fold: the transforms differ from the identity
        first = next(layer for _, layer in wl.whitening_layers(model))
        address = first.grad_transform.data_ptr()
        q_before = first.grad_transform.clone()
        losses = [run(x).square().mean() for x in xs]  # two folds, each after its forward
        assert not torch.equal(first.grad_transform, q_before)
        for loss in losses:
            loss.backward()
        assert first.grad_transform.data_ptr() == address
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not hasattr(torch.ops.aten.mm, "dtype"), reason=f"aten.mm.dtype (products with out_dtype): not in "
                                                                     f"torch {torch.__version__}")
def test_compiled_bf16_statistics_take_the_tensor_core_split():
    """On CUDA a compiled layer sums a bf16 batch about its shift on tensor cores: the float32 differences split in
    two bf16 numbers, two products with float32 output (``functional.accumulate_moments_split``), where the float32
    product of every layer would run on SIMT cores. Emulated on the CPU: ``mm`` / ``addmm`` with ``out_dtype``
    registered for the CPU (float32 products of the converted operands: exact for bf16 numbers, as CUDA's) and the
    layers told the device has them. The graphs hold those products with bf16 operands, there is no graph break
    and no recompilation, and the first block's statistics are eager's (float32 products) to the split's error.
    (Past the first fold, bf16 activations round apart between any two runs that differ at all: not compared.)"""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.to(out_dtype), b.to(out_dtype)), "CPU")
    lib.impl("addmm.dtype_out", lambda c, a, b, out_dtype, beta=1, alpha=1, *, out: out.copy_(
        torch.addmm(c.to(out_dtype), a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha)), "CPU")
    products = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.mm and node.kwargs.get("out_dtype") is not None:
                products.append(tuple(a.meta["example_value"].dtype for a in node.args))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def make():
        torch.manual_seed(0)
        model = wl.models.cifar_resnet(8, width=4).to(memory_format=torch.channels_last)
        return wl.convert_model(model, "grad", block_size=3)

    def train(model, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(steps):
            x = (torch.randn(4, 3, 8, 8, generator=gen) + 0.5).contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (4,), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = Fn.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    try:
        with pytest.MonkeyPatch.context() as mp, wl.functional.fused_moments(True):
            mp.setitem(wl.functional.batch._LOWP_PRODUCTS["addmm"], "cpu", True)
            torch._dynamo.reset()
            counters.clear()
            compiled_model, eager = make(), make()
            compiled = torch.compile(compiled_model, backend=backend)
            with recompile_limit(MAX_GRAPHS + 1):
                train(compiled, 3, seed=0)  # the first block, folded
                train(eager, 3, seed=0)
                first = [(layer.running_mean.clone(), layer.running_cov.clone())
                         for _, layer in wl.whitening_layers(compiled_model)]
                train(compiled, 4, seed=1)  # a second block and a step of the third: the same graphs
    finally:
        lib._destroy()
    assert 1 <= counters["stats"]["unique_graphs"] <= MAX_GRAPHS
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    layers = wl.whitening_layers(compiled_model)
    assert all(int(layer.num_blocks) == 2 for _, layer in layers)
    # per graph and layer: hi^T hi and hi^T lo, bf16 operands, float32 output
    assert products and set(products) == {(torch.bfloat16, torch.bfloat16)}
    assert len(products) % (2 * len(layers)) == 0, (len(products), len(layers))
    for (name, layer), (mean, cov) in zip(wl.whitening_layers(eager), first):
        for got, want in ((mean, layer.running_mean), (cov, layer.running_cov)):
            rel = float((got.double() - want.double()).norm() / want.double().norm())
            assert rel < 2e-5, (name, rel)  # measured: at most 4.4e-6 (a covariance)


def _counters() -> tuple:
    return counters["stats"]["unique_graphs"], sum(counters["frames"].values()), dict(counters["graph_break"])


def _compiled_counts(method: str, steps: int, **compile_kwargs) -> tuple:
    """Dynamo's counters (graphs, frames compiled, graph breaks) after the first compiled step and after ``steps``
    steps of a CIFAR ResNet-8 (block_size 3), plain (``method`` "plain") or converted; and the model."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = wl.models.cifar_resnet(8, width=4).double()
    if method != "plain":
        model = wl.convert_model(model, method, block_size=3)
    compiled = torch.compile(model, **compile_kwargs)
    first: list = []
    with recompile_limit(4):  # room to see a recompilation, should one happen
        _train(compiled, steps, after_step=lambda: first.append(_counters()) if not first else None)
    return first[0], _counters(), model


@pytest.mark.parametrize("method", METHODS)
def test_compiled_step_compiles_to_the_plain_models_graphs_over_three_blocks(method):
    """The converted step compiles to as many graphs as the plain model's (one), its very first step included
    (the first block's first batch), with no graph break and nothing compiled again after the first step over 3
    blocks and their folds."""
    (plain_graphs, _, _), (plain_after, _, _), _ = _compiled_counts("plain", 2, backend="aot_eager")
    first, after, model = _compiled_counts(method, 10, backend="aot_eager")  # 3 blocks of 3 and one step
    assert plain_graphs == plain_after == 1
    assert first[0] == after[0] == plain_graphs
    assert first[1] == after[1], (first, after)  # no frame compiled again: no recompilation
    assert not first[2] and not after[2], after[2]
    assert all(int(layer.num_blocks) == 3 for _, layer in wl.whitening_layers(model))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("WHITENLAYERS_TEST_COMPILE") != "1",
                    reason="code generation: WHITENLAYERS_TEST_COMPILE=1")
def test_compiled_reduce_overhead_compiles_one_graph_on_the_cpu():
    """``mode="reduce-overhead"`` (inductor; on a CPU without CUDA graphs, whose recordings are the GPU check): one
    graph, no graph break, no recompilation over 3 blocks, the state at one address (as under ``aot_eager``)."""
    first, after, model = _compiled_counts("grad", 10, mode="reduce-overhead")
    assert first[0] == after[0] == 1
    assert first[1] == after[1] and not after[2], (first, after)
    assert all(int(layer.num_blocks) == 3 for _, layer in wl.whitening_layers(model))


def _state_addresses(layer) -> dict:
    """The data pointers of what a compiled graph of ``layer`` reads or writes in its state: the forward's buffers,
    the block's accumulators and the tensor its batches are summed about."""
    names = list(layer._FORWARD_BUFFERS)
    out = {name: layer._buffers[name].data_ptr() for name in names}
    out["shift"] = layer._block.store.data_ptr()
    out["sums"] = (layer._block.acc if layer._block.acc is not None else layer._block.s2).data_ptr()
    return out


@pytest.mark.parametrize("method", METHODS)
def test_compiled_state_keeps_its_storage_from_the_first_step(method):
    """Every tensor of a layer's state that the compiled graph reads or writes keeps its storage from the very
    first step on, over 4 folds: the folds, outside the graph, write in place (a recorded CUDA graph stays valid:
    ``cudagraph_recorded_non_static_inputs`` 0 after the first block, the GPU check). The block's shift is that
    tensor from the first step on."""
    torch._dynamo.reset()
    model = _model(method)
    compiled = torch.compile(model, backend="aot_eager")
    layers = [layer for _, layer in wl.whitening_layers(model)]
    before = [_state_addresses(layer) for layer in layers]
    seen = []
    _train(compiled, 13, after_step=lambda: seen.append([_state_addresses(layer) for layer in layers]))
    assert all(int(layer.num_blocks) == 4 for layer in layers)
    assert all(step == before for step in seen)
    assert all(layer._block.shift is layer._block.store for layer in layers)


class _OneConv(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=groups)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize("groups", [1, 2])
def test_compiled_first_batch_takes_the_shift_and_sums_eager_chooses(groups):
    """The first block's first compiled batch is summed about the shift tensor's values (zeros), and moved outside
    the graph to the batch's mean, eager's shift: after one step the shift and the block's sums are eager's
    (float64, inputs of mean 50: the move is exact to rounding), and so is the first fold (block_size 2)."""
    def run(compile_: bool):
        torch.manual_seed(0)
        model = wl.convert_model(_OneConv(groups), "grad", predicate=lambda name, _: name == "conv", block_size=2)
        model = model.double()
        run_ = torch.compile(model, backend="aot_eager") if compile_ else model
        gen = torch.Generator().manual_seed(3)
        states = []
        for _ in range(2):
            run_(torch.randn(3, 4, 5, 5, generator=gen, dtype=torch.float64) * 2 + 50).square().mean().backward()
            layer = model.conv
            states.append([t.clone() for t in (layer._block.store, layer._block.s1, layer._block.s2,
                                               layer.running_mean, layer.running_cov)])
        return states

    torch._dynamo.reset()
    compiled, eager = run(True), run(False)
    for step_c, step_e in zip(compiled, eager):
        for got, want in zip(step_c, step_e):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_the_next_blocks_shift_keeps_its_tensor_across_folds(compiled):
    """Every block's shift is chosen into one tensor, the layer's for its life: a compiled graph reads it at one
    address over any number of blocks (CUDA graph trees record a graph again when an input moves: an H200 run
    recorded again at every fold)."""
    torch._dynamo.reset()
    model = _model("grad")
    run = torch.compile(model, backend="aot_eager") if compiled else model
    layers = [layer for _, layer in wl.whitening_layers(model)]
    first = [layer._block.store.data_ptr() for layer in layers]
    seen = []
    _train(run, 13, after_step=lambda: seen.append(
        [layer._block.store.data_ptr() for layer in layers if layer._block.shift in (None, layer._block.store)]))
    assert all(int(layer.num_blocks) == 4 for layer in layers)
    assert all(ptrs == first for ptrs in seen)  # (the shift is the tensor, or not chosen yet: after a fold)


class _Detector(torch.nn.Module):
    """A backbone and a head, as detection and contrastive models are: users compile the backbone alone."""

    def __init__(self) -> None:
        super().__init__()
        net = wl.models.cifar_resnet(8, width=4)
        self.backbone = torch.nn.Sequential(net.conv1, net.bn1, torch.nn.ReLU(), net.layer1, net.layer2, net.layer3)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.backbone(x).mean((2, 3)))


def _detector(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return wl.convert_model(_Detector().double(), method, block_size=3, targets="all")


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_a_compiled_submodule_trains_as_the_eager_root(method):
    """``torch.compile(model.backbone)`` called directly (the root's hooks never run): its layers count their batches
    through a graph break each and fold at their blocks' ends, as the eager root run does (3 blocks, float64), and
    nothing dynamo guards on grows per call: no recompilation after the first block."""
    torch._dynamo.reset()
    counters.clear()
    model, eager = _detector(method), _detector(method)
    backbone = torch.compile(model.backbone, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, eager)]
    graphs = []
    for step in range(9):
        x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 0.5
        y = torch.randint(0, 10, (4,), generator=gen)
        for opt, out in ((opts[0], lambda: model.head(backbone(x).mean((2, 3)))), (opts[1], lambda: eager(x))):
            opt.zero_grad()
            Fn.cross_entropy(out(), y).backward()
            opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[-1], graphs  # compiled in the first block, never again
    layers = wl.whitening_layers(model)
    assert all(int(layer.num_blocks) == 3 and layer.batches_in_block == 0 for _, layer in layers)
    _assert_same_state(model, eager)
