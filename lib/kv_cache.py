"""
The KV cache, as transformers keeps it: what rollout.py's prefill and decode loop (and the experiments that run
their own loops) need from it, in one place.

  cache_kwargs   the cache as a forward's keyword (its name changed in transformers 5.x)
  cache_of       the cache a forward returned
  preallocate    each layer given room for the tokens a decode loop will add: written in place, not
                 concatenated (Preallocated); one layer at a time, so the prefill's copy goes as it comes

Try it on CPU:  python -m pytest tests/test_memory.py -q
"""
import functools
import inspect

from transformers.cache_utils import DynamicLayer


def cache_kwargs(model, cache):
    """The KV cache as a forward's keyword: `cache`, the name transformers 5.x moved to (the old
    name, past_key_values, prints a FutureWarning on every call), or past_key_values where the
    model has no other."""
    return {cache_name(type(model)): cache}


@functools.lru_cache(maxsize=None)
def cache_name(model_class):
    names = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def cache_of(out):
    """The KV cache a forward returned, by its name in this transformers version."""
    return out.cache if "cache" in out else out.past_key_values


def preallocate(cache, extra):
    """Give every plain layer of `cache` room for `extra` more tokens (Preallocated); other layer types
    (sliding windows, quantised) are left as they are. One layer at a time, in place in the cache's list, so
    each layer's prefill copy is freed as its buffer is filled: the cache's memory grows by one layer's
    buffer, not by a second copy of the whole cache. (Building the new list whole kept the G-fold prefill
    cache beside the buffers: 12.96 GiB beside 14.08 GiB on an H200 at the default team's 256 rows, 4x long
    prompts; tests/test_memory.py counts the layers alive.)"""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = Preallocated(layer, extra)
    return cache


class Preallocated(DynamicLayer):
    """One layer of HF's DynamicCache with room for `extra` tokens reserved up front.
    DynamicLayer.update torch.cat-s the whole history for every new token: O(T^2) copying, 35 %
    of the rollout's time measured on the pocket policy (8 x 64 tokens after a 193-token prompt).
    Here each token is written in place and keys/values are views of the filled part, so shapes
    and masks are exactly DynamicLayer's."""

    def __init__(self, layer, extra):
        super().__init__()
        (N, H, P, Dk), Dv = layer.keys.shape, layer.values.shape[-1]
        self.k_buf = layer.keys.new_empty(N, H, P + extra, Dk)  # (B*G, heads, P + extra, head dim)
        self.v_buf = layer.values.new_empty(N, H, P + extra, Dv)
        self.k_buf[:, :, :P], self.v_buf[:, :, :P] = layer.keys, layer.values
        self.n, self.keys, self.values = P, self.k_buf[:, :, :P], self.v_buf[:, :, :P]
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        n = self.n + key_states.shape[-2]
        self.k_buf[:, :, self.n:n], self.v_buf[:, :, self.n:n] = key_states, value_states
        self.n, self.keys, self.values = n, self.k_buf[:, :, :n], self.v_buf[:, :, :n]
        return self.keys, self.values
