"""Merged projections over quantized weights (``transfuse.ops.quantized``): the parts' quantized data
and scales concatenated in the scheme's own storage, run through the scheme's own kernel.

Each merged module's output equals its parts' own outputs bit for bit (the schemes here compute each
output column independently on CPU); the parts stay under their names as views of the merged storage
(no byte stored twice, same types); the model's ``state_dict`` and ``save_pretrained`` are the stock
quantized model's, and a stock transformers load of them gives the same tensors bit for bit."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import transfuse
from transfuse.ops.quantized import QuantizedProjection
from transfuse.ops.quantized.base import cpu_int4_rows_concatenate
from transfuse.rewriter.weights import MergeError, merge_linears, unmerge_linears
from transfuse.tiny import tiny_model


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _torchao_int4():  # int4 weight-only for CPU (Int4OpaqueTensor, tinygemm's _weight_int4pack_mm_for_cpu)
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=32))


def _torchao_float8():
    from torchao.quantization import Float8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Float8WeightOnlyConfig())


def _bnb(**kwargs):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**kwargs)


def _quanto_int8():
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


SCHEMES = {
    "torchao-int8": ("torchao", _torchao_int8),
    "torchao-int4": ("torchao", _torchao_int4),
    "torchao-float8": ("torchao", _torchao_float8),
    "bnb-int8": ("bitsandbytes", lambda: _bnb(load_in_8bit=True)),
    "bnb-nf4": ("bitsandbytes", lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4")),
    "bnb-fp4": ("bitsandbytes", lambda: _bnb(load_in_4bit=True, bnb_4bit_quant_type="fp4")),
    "quanto-int8": ("optimum.quanto", _quanto_int8),
}
# transformers cannot save quanto models, nor torchao's Int4OpaqueTensor
SAVABLE = ("torchao-int8", "torchao-float8", "bnb-int8", "bnb-nf4")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory):
    """q, k and v of 64 rows each: whole blocks of the CPU int4 packing on every CPU."""
    path = tmp_path_factory.mktemp("tiny-llama-mha")
    tiny_model("llama", num_key_value_heads=4).save_pretrained(path)
    return path


def _blocked_int4_packing(monkeypatch):
    """A CPU int4 packing that interleaves blocks of 64 output rows (as AVX-512's does), a part's last
    partial block otherwise than a whole one, seen by ``cpu_int4_rows_concatenate`` only."""
    real = torch._convert_weight_to_int4pack_for_cpu

    def blocked(codes, inner_k_tiles):
        n = codes.shape[0]
        order = [i for start in range(0, n, 64) for i in reversed(range(start, min(start + 64, n)))]
        return real(codes[order], inner_k_tiles)

    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", blocked)
    cpu_int4_rows_concatenate.cache_clear()


def _load(path, scheme, config=None):
    package, make = SCHEMES[scheme]
    if importlib.util.find_spec(package.partition(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config or make(), device_map="cpu").eval()


def _flat(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass's inner tensors (recursively), else the tensor: what is stored."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _flat(getattr(tensor, name))]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8) if tensor.dtype != torch.bool else tensor


def _same_bits(a: dict, b: dict) -> list[str]:
    """The keys whose stored tensors differ in type, dtype, shape or bytes (and those one side lacks)."""
    differ = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = _flat(a[key]), _flat(b[key])
        if type(a[key]) is not type(b[key]) or len(x) != len(y):
            differ.append(key)
        elif not all(p.dtype == q.dtype and p.shape == q.shape and torch.equal(_bits(p), _bits(q)) for p, q in zip(x, y)):
            differ.append(key)
    return differ


def _inside(piece: torch.Tensor, whole: list[torch.Tensor]) -> bool:
    start, end = piece.data_ptr(), piece.data_ptr() + piece.numel() * piece.element_size()
    return any(w.data_ptr() <= start and end <= w.data_ptr() + w.numel() * w.element_size() for w in whole)


@pytest.mark.parametrize("ran_first", [False, True], ids=["unrun", "ran"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_quantized_merge_computes_its_parts_bit_for_bit_in_their_storage(request, scheme, ran_first):
    # int4 packed for the CPU kernel merges where each part but the last is whole blocks of its packing
    checkpoint = request.getfixturevalue("mha_checkpoint" if scheme == "torchao-int4" else "checkpoint")
    model, stock = _load(checkpoint, scheme), _load(checkpoint, scheme)
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    names = ["q_proj", "k_proj", "v_proj"]
    for each in (model, stock):
        if ran_first:  # bitsandbytes repacks 4-bit weights for its AVX512 CPU kernel on the first call
            with torch.no_grad():
                each(torch.randint(0, 200, (1, 4)))
        else:  # the original 4-bit layout, through bitsandbytes' kernel for it
            for part in each.modules():
                if hasattr(part, "support_avx512bf16_for_cpu"):
                    part.support_avx512bf16_for_cpu = False
        with torch.no_grad():
            want = [getattr(each.model.layers[0].self_attn, n)(x) for n in names]
    attention = model.model.layers[0].self_attn
    parts = [getattr(attention, n) for n in names]
    types = [type(p.weight) for p in parts]

    merged = merge_linears(attention, "qkv_proj", names)

    assert isinstance(merged, QuantizedProjection)
    assert [getattr(attention, n) for n in names] == parts  # the original modules, under their names
    assert [type(p.weight) for p in parts] == types
    scheme_of = merged.scheme
    stored = [t for m in [merged.kernel] if isinstance(m, torch.nn.Module) for t in scheme_of.tensors(m)]
    stored = stored or [t for t in _flat(merged.kernel[0])]
    for part in parts:  # each part's quantized tensors lie in the merged storage: nothing stored twice
        apart = [t for t in scheme_of.tensors(part) if not _inside(t, stored)]
        # except Int4OpaqueTensor's scale_and_zero, [in / group, out, 2]: its kernel reads a part's columns
        # as contiguous, so the merged layer holds the scales once more (ops/quantized/torchao.py)
        assert apart == ([part.weight.scale_and_zero] if scheme == "torchao-int4" else [])
    assert merged.quantized_bytes() == sum(t.numel() * t.element_size() for t in stored)
    with torch.no_grad():
        got = merged(x).split(merged.split_sizes, dim=-1)
        again = [p(x) for p in parts]  # the parts still compute what they computed, from the views
    for g, w, a in zip(got, want, again):
        assert torch.equal(g, w)
        assert torch.equal(a, w)
    # (A state_dict() of a 4-bit layer bitsandbytes repacked changes the layer: taken last, on both.)
    assert list(attention.state_dict()) == list(stock.model.layers[0].self_attn.state_dict())
    assert _same_bits(attention.state_dict(), stock.model.layers[0].self_attn.state_dict()) == []

    unmerge_linears(attention, "qkv_proj")
    assert not hasattr(attention, "qkv_proj")
    with torch.no_grad():
        assert all(torch.equal(p(x), w) for p, w in zip(parts, want))


def test_a_merge_follows_parts_whose_tensors_were_replaced(checkpoint):
    model = _load(checkpoint, "torchao-int8")
    mlp = model.model.layers[0].mlp
    merged = merge_linears(mlp, "gate_up_proj", ["gate_proj", "up_proj"])
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    mlp.up_proj.weight.qdata = mlp.up_proj.weight.qdata.flip(0).contiguous()  # new storage
    with torch.no_grad():
        got = merged(x).split(merged.split_sizes, dim=-1)
        assert torch.equal(got[1], mlp.up_proj(x)) and torch.equal(got[0], mlp.gate_proj(x))


def test_double_quantised_4bit_is_refused_naming_the_scheme(checkpoint):
    config = _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = _load(checkpoint, "bnb-nf4", config)
    with pytest.raises(MergeError, match=r"bitsandbytes 4-bit: .*double quantisation"):
        merge_linears(model.model.layers[0].mlp, "gate_up_proj", ["gate_proj", "up_proj"])


def test_parts_of_different_schemes_are_refused(checkpoint):
    model = _load(checkpoint, "torchao-int8")
    mlp = model.model.layers[0].mlp
    mlp.up_proj = torch.nn.Linear(model.config.hidden_size, model.config.intermediate_size, bias=False)
    with pytest.raises(MergeError, match=r"'up_proj' is Linear, 'gate_proj' is torchao Int8Tensor"):
        merge_linears(mlp, "gate_up_proj", ["gate_proj", "up_proj"])


@pytest.mark.parametrize("scheme", SAVABLE)
def test_a_rewritten_quantized_model_saves_the_stock_checkpoint(checkpoint, scheme, tmp_path):
    stock, model = _load(checkpoint, scheme), _load(checkpoint, scheme)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts().get("qkv") == 2 and report.counts().get("gate_up") == 2, report
    assert not [s for s in report.skipped if s.kind in ("qkv", "gate_up")], report.skipped
    with torch.no_grad():
        stock_out, got = stock(ids).logits, model(ids).logits
    assert torch.equal(got, stock_out) or (got - stock_out).abs().max() <= 1e-5 * stock_out.abs().max()

    stock.save_pretrained(tmp_path / "stock")
    model.save_pretrained(tmp_path / "rewritten")
    files = sorted(p.name for p in (tmp_path / "stock").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "rewritten").glob("*.safetensors"))
    for name in files:
        assert _same_bits(load_file(tmp_path / "stock" / name), load_file(tmp_path / "rewritten" / name)) == []
    configs = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("stock", "rewritten")]
    assert configs[0] == configs[1]
    loaded = [AutoModelForCausalLM.from_pretrained(tmp_path / d, device_map="cpu") for d in ("stock", "rewritten")]
    assert _same_bits(loaded[0].state_dict(), loaded[1].state_dict()) == []


def test_quanto_int4_is_refused_naming_its_packing():
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        pytest.skip("optimum-quanto is not installed")
    from optimum.quanto import freeze, qint4, quantize

    module = torch.nn.Module()
    module.a, module.b = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
    quantize(module, weights=qint4)
    freeze(module)
    match = r"optimum-quanto: a is optimum-quanto qint4 WeightQBitsTensor: its PackedTensor puts grouped rows i and i \+ n/2"
    with pytest.raises(MergeError, match=match):
        merge_linears(module, "ab", ["a", "b"])


@pytest.fixture
def fresh_int4_probe():
    cpu_int4_rows_concatenate.cache_clear()
    yield
    cpu_int4_rows_concatenate.cache_clear()


def test_cpu_int4_merges_are_refused_where_the_packing_blocks_rows_across_parts(checkpoint, monkeypatch, fresh_int4_probe):
    """Counted at the probe: under a packing that interleaves blocks of 64 rows, parts of 64, 32 and
    32 rows (q, k, v of the tiny llama) are refused with the reason, whole blocks are not."""
    model = _load(checkpoint, "torchao-int4")
    _blocked_int4_packing(monkeypatch)
    assert cpu_int4_rows_concatenate((64, 64, 128))
    attention = model.model.layers[0].self_attn
    with pytest.raises(MergeError, match=r"packed for this CPU's int4 kernel.*parts of 64, 32, 32 rows"):
        merge_linears(attention, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
    assert cpu_int4_rows_concatenate.cache_info().misses == 2


def test_quanto_int4_for_tinygemm_is_refused_where_the_packing_blocks_rows_across_parts(monkeypatch, fresh_int4_probe):
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        pytest.skip("optimum-quanto is not installed")
    from optimum.quanto import freeze, qint4, quantize

    module = torch.nn.Module()
    for name, width in (("a", 64), ("b", 32), ("c", 32)):
        setattr(module, name, torch.nn.Linear(256, width, bias=False, dtype=torch.bfloat16))
    quantize(module, weights=qint4)
    freeze(module)
    _blocked_int4_packing(monkeypatch)
    with pytest.raises(MergeError, match=r"packed for this CPU's int4 kernel.*parts of 64, 32, 32 rows"):
        merge_linears(module, "abc", ["a", "b", "c"])


def test_quanto_int4_for_tinygemm_merges_its_code_rows_bit_for_bit():
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        pytest.skip("optimum-quanto is not installed")
    from optimum.quanto import freeze, qint4, quantize

    module = torch.nn.Module()  # bfloat16, groups of 128, on a CPU: quanto packs int4 for tinygemm
    for name, width in (("a", 128), ("b", 64), ("c", 64)):  # whole blocks of the CPU int4 packing
        setattr(module, name, torch.nn.Linear(256, width, bias=False, dtype=torch.bfloat16))
    quantize(module, weights=qint4)
    freeze(module)
    parts = [module.a, module.b, module.c]
    assert {type(p.weight).__name__ for p in parts} == {"TinyGemmWeightQBitsTensor"}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        want = [p(x) for p in parts]
        merged = merge_linears(module, "abc", ["a", "b", "c"])
        got = merged(x).split(merged.split_sizes, dim=-1)
        again = [p(x) for p in parts]
    assert merged.storage == "optimum-quanto qint4 TinyGemmWeightQBitsTensor"
    assert all(torch.equal(g, w) and torch.equal(a, w) for g, w, a in zip(got, want, again))
    codes = merged.kernel[0]._data._data
    # the code rows are views of the merged codes; the scales [in / group, out, 2] stay each part's own
    assert all(_inside(p.weight._data._data, [codes]) and not _inside(p.weight._scale_shift, [merged.kernel[0]._scale_shift]) for p in parts)


def _tile_packed_attention(widths, in_features=256, group=128, on_cuda=False):
    """q/k/v of torchao's CUDA int4 layout (``Int4TilePackedTo4dTensor``). On a CUDA GPU, quantized by
    torchao; elsewhere (tinygemm's packing is CUDA-only) built from random codes and scales of the
    layout's shapes, whose storage can be merged but not run."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor

    generator = torch.Generator().manual_seed(4)
    module = torch.nn.Module()
    for name, width in zip(("q_proj", "k_proj", "v_proj"), widths):
        layer = torch.nn.Linear(in_features, width, bias=False, dtype=torch.bfloat16, device="cuda" if on_cuda else "cpu")
        if on_cuda:
            with torch.no_grad():
                layer.weight.copy_(torch.randn(width, in_features, generator=generator).to(layer.weight))
            weight = Int4TilePackedTo4dTensor.from_hp(layer.weight.detach(), [1, group])
        else:
            tiles = -(-width // 8)
            codes = torch.randint(-(2**31), 2**31 - 1, (tiles, in_features // 128, 32, 4), dtype=torch.int32, generator=generator)
            scales = torch.randn(in_features // group, tiles * 8, 2, generator=generator).to(torch.bfloat16)
            weight = Int4TilePackedTo4dTensor(codes, scales, [1, group], torch.Size([width, in_features]))
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        setattr(module, name, layer)
    return module


def test_torchao_int4_tile_packed_parts_merge_their_tiles_of_eight_outputs():
    module = _tile_packed_attention((64, 32, 32))
    parts = [module.q_proj, module.k_proj, module.v_proj]
    codes, scales = [p.weight.qdata.clone() for p in parts], [p.weight.scale_and_zero for p in parts]
    merged = merge_linears(module, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
    weight = merged.kernel[0]
    assert type(weight).__name__ == "Int4TilePackedTo4dTensor" and weight.shape == (128, 256)
    assert torch.equal(weight.qdata, torch.cat(codes))  # [out / 8, in / 128, 32, 4]: tiles follow tiles
    assert torch.equal(weight.scale_and_zero, torch.cat(scales, dim=1))  # [in / group, out, 2]
    for part, own_codes, own_scales in zip(parts, codes, scales):
        # each part's codes are a view of its tiles in the merged codes; its scales stay its own
        assert torch.equal(part.weight.qdata, own_codes) and _inside(part.weight.qdata, [weight.qdata])
        assert part.weight.qdata.is_contiguous() and part.weight.scale_and_zero is own_scales


def test_torchao_int4_tile_packed_parts_with_a_padded_tile_are_refused():
    module = _tile_packed_attention((64, 36, 36))
    with pytest.raises(MergeError, match=r"k_proj.weight .* packs 8 outputs a tile: its 36 outputs end in a padded tile"):
        merge_linears(module, "qkv_proj", ["q_proj", "k_proj", "v_proj"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm's int4 packing needs a CUDA GPU")
def test_torchao_int4_tile_packed_merge_computes_its_parts_bit_for_bit_on_cuda():
    module = _tile_packed_attention((64, 32, 32), in_features=1024, on_cuda=True)
    parts = [module.q_proj, module.k_proj, module.v_proj]
    x = torch.randn(3, 5, 1024, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        want = [p(x) for p in parts]
        merged = merge_linears(module, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        got = merged(x).split(merged.split_sizes, dim=-1)
        again = [p(x) for p in parts]
    assert all(torch.equal(g, w) and torch.equal(a, w) for g, w, a in zip(got, want, again))


def _fp8_attention(widths, block=(32, 32), in_features=64):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    generator = torch.Generator().manual_seed(3)
    module = torch.nn.Module()
    for name, width in zip(("q_proj", "k_proj", "v_proj"), widths):
        layer = FP8Linear(in_features, width, block_size=block)
        layer.weight.data = (torch.randn(width, in_features, generator=generator) * 8).to(torch.float8_e4m3fn)
        layer.weight_scale_inv.data = torch.rand(layer.weight_scale_inv.shape, generator=generator) / 64 + 1e-3
        setattr(module, name, layer)
    return module


def test_block_fp8_parts_merge_and_compute_as_transformers_dequantises_them():
    from tests.test_moe_fp8 import dequantised

    module = _fp8_attention((64, 32, 32))
    names = ["q_proj", "k_proj", "v_proj"]
    parts = [getattr(module, n) for n in names]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)
    want = [
        torch.nn.functional.linear(x, dequantised(p.weight, p.weight_scale_inv, p.block_size, x.dtype))
        for p in parts
    ]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    merged = merge_linears(module, "qkv_proj", names)
    assert merged.storage == "block FP8 torch.float8_e4m3fn (32x32 scales)"
    for got, w in zip(merged(x).split(merged.split_sizes, dim=-1), want):
        assert torch.equal(got, w)
    assert _same_bits(module.state_dict(), before) == []
    stored = merged.scheme.tensors(merged.kernel)
    assert all(_inside(t, stored) for p in parts for t in merged.scheme.tensors(p))


def test_block_fp8_parts_whose_width_splits_a_block_are_refused():
    module = _fp8_attention((64, 48, 48))
    with pytest.raises(MergeError, match=r"block FP8: k_proj .* 48 outputs, not a multiple of the block's 32 rows"):
        merge_linears(module, "qkv_proj", ["q_proj", "k_proj", "v_proj"])


def test_qlora_on_a_rewritten_4bit_model_matches_stock_peft(checkpoint):
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed")
    from peft import LoraConfig, get_peft_model

    stock, model = _load(checkpoint, "bnb-nf4"), _load(checkpoint, "bnb-nf4")
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock(ids)  # the rewrite runs the model too (bitsandbytes repacks on CPUs with AVX512-BF16)
    transfuse.rewrite(model)
    assert transfuse.report(model).counts()["qkv"] == 2
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    results = []
    for each in (stock, model):
        torch.manual_seed(5)  # the same adapter weights (non-zero B) on both
        peft_model = get_peft_model(each, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        peft_model.train()
        out = peft_model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
        results.append((out.logits.detach(), grads))
    (want, want_grads), (got, got_grads) = results
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedProjection)
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) == 2 * len(targets) * 2
    # The gradients: the merged layer's input gradient is one product over the concatenated
    # outputs where stock PEFT adds three, a different summation order (bit-equal where bitsandbytes
    # repacks the weights for AVX512-BF16 CPUs, whose backward dequantises the same way for both):
    # equal within float32 rounding of those sums.
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
