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
