"""Spying on a layer's decode steps: the stepper a layer chose (``h2okv.core.decode``) runs each one."""

from h2okv.core.decode import STEPPERS


def spy_decode_steps(monkeypatch, wrap):
    """Replace each stepper's ``decode(layer, query, k_new, v_new, scaling)`` by ``wrap(original)``,
    a function of the same arguments (without the stepper)."""
    for stepper in STEPPERS:
        original = stepper.decode

        def patched(self, *args, _original=original, **kwargs):
            return wrap(lambda *a, **k: _original(self, *a, **k))(*args, **kwargs)

        monkeypatch.setattr(stepper, "decode", patched)
