"""lora.py against the plain matrix maths and against PEFT (an independent implementation)."""
import copy

import pytest
import torch
import torch.nn as nn

from lora import LoRALinear, apply_lora, load_lora_state_dict, lora_disabled, lora_state_dict, save_peft


def randomise_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 99, 3, 42, 7], [8, 8, 120, 64, 1, 2]])


def test_formula_matches_plain_maths():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoRALinear(copy.deepcopy(base), rank=3, alpha=12)
    A, B = torch.randn(3, 6), torch.randn(5, 3)
    layer.lora_A.data, layer.lora_B.data = A.clone(), B.clone()
    x = torch.randn(4, 6)
    expected = x @ base.weight.T + base.bias + (12 / 3) * x @ A.T @ B.T
    torch.testing.assert_close(layer(x), expected)


def test_noop_at_init_and_only_lora_trains(tiny_policy):
    model = copy.deepcopy(tiny_policy[0])
    before = logits(model, IDS)
    names = apply_lora(model, rank=4, alpha=8)
    assert len(names) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert torch.equal(logits(model, IDS), before)  # B = 0: exactly the base model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A" in n or ".lora_B" in n for n in trainable)


def test_lora_disabled_gives_base_and_restores(tiny_policy):
    model = copy.deepcopy(tiny_policy[0])
    base = logits(model, IDS)
    apply_lora(model)
    randomise_lora(model)
    adapted = logits(model, IDS)
    assert not torch.allclose(adapted, base)
    with lora_disabled(model):
        torch.testing.assert_close(logits(model, IDS), base)
    torch.testing.assert_close(logits(model, IDS), adapted)
    with pytest.raises(RuntimeError), lora_disabled(model):
        raise RuntimeError("boom")
    torch.testing.assert_close(logits(model, IDS), adapted)  # re-enabled even after an exception


def test_matches_peft_given_same_weights(tiny_policy):
    peft = pytest.importorskip("peft")
    ours = copy.deepcopy(tiny_policy[0])
    names = apply_lora(ours, rank=4, alpha=8)
    randomise_lora(ours)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=sorted({n.split(".")[-1] for n in names}))
    theirs = peft.get_peft_model(copy.deepcopy(tiny_policy[0]), cfg)
    sd = lora_state_dict(ours)
    for name, module in theirs.base_model.model.named_modules():
        if name in names:
            module.lora_A["default"].weight.data = sd[f"{name}.lora_A"].clone()
            module.lora_B["default"].weight.data = sd[f"{name}.lora_B"].clone()
    torch.testing.assert_close(logits(ours, IDS), logits(theirs, IDS), rtol=1e-5, atol=1e-5)


def test_peft_export_loads_with_peft(tiny_policy, tmp_path):
    peft = pytest.importorskip("peft")
    ours = copy.deepcopy(tiny_policy[0])
    apply_lora(ours, rank=4, alpha=8)
    randomise_lora(ours, seed=1)
    save_peft(ours, str(tmp_path / "adapter"), "tiny:llama")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_policy[0]), str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(loaded, IDS), logits(ours, IDS), rtol=1e-5, atol=1e-5)


def test_state_dict_roundtrip_and_mismatch(tiny_policy):
    a, b = copy.deepcopy(tiny_policy[0]), copy.deepcopy(tiny_policy[0])
    apply_lora(a, rank=4)
    apply_lora(b, rank=4)
    randomise_lora(a, seed=3)
    load_lora_state_dict(b, lora_state_dict(a))
    torch.testing.assert_close(logits(a, IDS), logits(b, IDS))
    c = copy.deepcopy(tiny_policy[0])
    apply_lora(c, rank=2)
    with pytest.raises(ValueError, match="shape"):
        load_lora_state_dict(c, lora_state_dict(a))


def test_no_matching_module_is_an_error():
    with pytest.raises(ValueError, match="no nn.Linear"):
        apply_lora(nn.Sequential(nn.Linear(2, 2)), target_modules=("q_proj",))


def test_lora_merged_is_the_same_function_and_restores_weights_bit_for_bit():
    """lora_merged (used by the rollout) computes x (W + s B A)^T: the same outputs as the unmerged layers
    (float rounding aside), and on exit every frozen weight is the very same tensor with the same bits."""
    from lora import lora_merged
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    apply_lora(model, rank=4, alpha=8, target_modules=("0", "2"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p)
    frozen = [(m.base.weight, m.base.weight.data.clone()) for m in model.modules() if isinstance(m, LoRALinear)]
    x = torch.randn(5, 16)
    y = model(x)
    with lora_merged(model):
        y_merged = model(x)
        assert all(not torch.equal(w.data, before) for w, before in frozen)  # really merged inside
    torch.testing.assert_close(y_merged, y, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(w.data, before) for w, before in frozen)
    assert torch.equal(model(x), y)
    with lora_disabled(model), lora_merged(model):  # disabled layers are not merged
        torch.testing.assert_close(model(x), model[2].base(torch.relu(model[0].base(x))))


def test_lora_merged_keep_merges_into_one_buffer_and_restores_weights_bit_for_bit():
    """keep=True (the captured decode step's merge): W + s B A is written into the same buffer every time (a CUDA
    graph captured once reads it there), with the same values as the merge into a new tensor, and W comes back."""
    from lora import lora_merged
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(8, 8))
    apply_lora(model)
    layer = model.q_proj
    with torch.no_grad():
        layer.lora_B.normal_()
    w, w0 = layer.base.weight.data_ptr(), layer.base.weight.detach().clone()
    x = torch.randn(3, 8)
    ptrs, outs = [], []
    for step in range(2):
        with lora_merged(model):
            want = model(x)
        with lora_merged(model, keep=True):
            ptrs.append(layer.base.weight.data_ptr())
            outs.append(model(x))
        assert torch.equal(outs[-1], want) and layer.base.weight.data_ptr() == w
        assert torch.equal(layer.base.weight, w0)  # W itself, bit for bit
        with torch.no_grad():
            layer.lora_B.add_(0.1)  # the optimiser's step, in place
    assert ptrs[0] == ptrs[1] != w and not torch.equal(outs[0], outs[1])
