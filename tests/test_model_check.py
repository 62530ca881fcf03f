"""support/harness/model_check.py: what a model flag names is checked before anything loads, in seconds."""
import socket
import time

import pytest

from support.harness import model_check


def test_a_hub_model_fails_in_seconds_when_the_hub_cannot_be_reached(monkeypatch):
    """Regression (a newcomer's friction): without a network, `--team default` spent 26 s on 11 lines of
    huggingface_hub's retries before its one clear error (2 s with HF_HUB_OFFLINE=1). Now an uncached hub id asks
    the hub once, with a short timeout, and the flag fails in one line."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(address, timeout=None):
        raise OSError("network is unreachable")
    monkeypatch.setattr(socket, "create_connection", no_network)
    t0 = time.time()
    with pytest.raises(ValueError, match="--policy: model 'nobody/not-cached-7b' .* cannot be reached"):
        model_check.check_models([("nobody/not-cached-7b", "--policy")])
    assert time.time() - t0 < 10


def test_the_hub_is_asked_only_for_a_model_that_is_not_local(monkeypatch, tmp_path):
    asked = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(model_check, "hub_reachable", lambda timeout=3.0: asked.append(1) or True)
    model_check.check_models([("tiny:llama", "--policy"), ("nobody/not-cached-7b", "--experts")])
    assert asked == [1]                                         # the tiny model needs no hub; the hub id does
