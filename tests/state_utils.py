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
    """``model`` without its fold coordinator: each layer folds alone, at its own block's end (what the coordinator
    does for all the layers together at the forward's end). The reference of what the coordinator only batches."""
    coordinator = coordinator_of(model)
    coordinator.handle.remove()
    coordinator.begin_handle.remove()
    for _, layer in __import__("whitenlayers").whitening_layers(model):
        layer.make_standalone()
    return model
