"""Comparing two models' state dicts in the tests: floating tensors to a stated tolerance, the rest exactly."""
import torch


def assert_states_close(got, want, *, rtol, atol):
    """Every entry of ``want`` in ``got``: floating tensors within ``rtol`` / ``atol`` (named in the message), other
    tensors (counters) equal."""
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=key)
        else:
            assert torch.equal(got[key], value), key


def coordinator_of(model):
    """The fold coordinator ``convert_model`` installed on ``model``."""
    from whitenlayers.coordinator import FoldCoordinator

    return next(h for h in model._forward_hooks.values() if isinstance(h, FoldCoordinator))


def layers_alone(model):
    """``model`` whose coordinator opens empty scopes: no shared node, no handed batch, each layer does its own work
    (the folds still come at the forward's end, stacked). The reference of what the coordinator only batches."""
    import threading

    from whitenlayers.coordinator import ForwardScope

    coordinator = coordinator_of(model)
    keys = [k for k, h in model._forward_pre_hooks.items() if getattr(h, "__self__", None) is coordinator]
    if not keys:  # alone already
        return model
    key = keys[0]

    def begin(module, inputs):
        if torch.compiler.is_compiling():
            return coordinator.begin_forward(module, inputs)
        coordinator.scopes.setdefault(threading.get_ident(), ForwardScope({}, {}, None))

    model._forward_pre_hooks[key] = begin
    return model
