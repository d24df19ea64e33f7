"""`--quantization fp8` against a quantizer written here, independently of ops/fp8_gemm: torch's
float8_e4m3fn cast of each 128x128 block divided by its amax / 448, dequantized, plain matmuls.
The model is SmolLM2-shaped (tied embeddings, 192-row k/v parts of the fused q | k | v, so its
blocks would straddle two projections if the scale grid were the fused tensor's). Checked: every
projection's loaded weight dequantizes bit-equal to the independent one, part by part; the
embedding (the tied LM head) and the RMSNorm weights stay float and equal the checkpoint's; and a
prefill (> DECODE_ROWS rows, the W8A8 path) of one layer matches the independent per-token-group
activation rounding."""
import pytest
import torch

from qsaserve.layers.quantization import Fp8Linear
from qsaserve.loader import load_checkpoint
from qsaserve.models.registry import build_model
from qsaserve.ops.fp8_gemm import DECODE_ROWS, W8A16_ROWS, fp8_linear
from qsaserve.parallel.state import ParallelContext

E4M3_MAX = 448.0


def _independent_block_dequant(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """w [N, K] -> its block-FP8 rounding, dequantized (float32 [N, K]), one block at a time."""
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            tile = w[i:i + block, j:j + block].float()
            scale = tile.abs().max() / E4M3_MAX
            out[i:i + block, j:j + block] = (tile / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def _independent_token_group_dequant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x [M, K] -> its per-token, per-128-column FP8 rounding, dequantized."""
    out = torch.empty_like(x)
    for j in range(0, x.shape[1], group):
        cols = x[:, j:j + group]
        scale = cols.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        out[:, j:j + group] = (cols / scale).to(torch.float8_e4m3fn).float() * scale
    return out


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("smollm2_shaped")
    cfg = LlamaConfig(vocab_size=320, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a norm rounded to FP8 would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.3, 3.0)
    hf.save_pretrained(path)
    ck = load_checkpoint(str(path))
    model = build_model(ck.hf_config, 128, ParallelContext(tp_size=1, tp_rank=0), "fp8")
    model.load_weights(ck.weights(torch.float32))
    return model, {k: v.float() for k, v in hf.state_dict().items()}


def test_every_projection_dequantizes_to_the_independent_block_rounding(smollm2_shaped):
    model, hf = smollm2_shaped
    layer, prefix = model.layers[0], "model.layers.0."
    fused = {layer.self_attn.qkv_proj: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             layer.self_attn.o_proj: ("self_attn.o_proj",),
             layer.mlp.gate_up_proj: ("mlp.gate_proj", "mlp.up_proj"),
             layer.mlp.down_proj: ("mlp.down_proj",)}
    for module, parts in fused.items():
        assert isinstance(module, Fp8Linear)
        for i, name in enumerate(parts):
            want = _independent_block_dequant(hf[f"{prefix}{name}.weight"])
            assert torch.equal(module.dequantized(i, torch.float32), want), name


def test_embedding_tied_head_and_norms_stay_float(smollm2_shaped):
    model, hf = smollm2_shaped
    assert model.lm_head is None  # tied: the logits read the embedding
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert norms and all(p.dtype == torch.float32 for p in norms.values())
    assert torch.equal(model.norm.weight, hf["model.norm.weight"])
    assert torch.equal(model.layers[0].input_layernorm.weight, hf["model.layers.0.input_layernorm.weight"])
    quantized = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert sorted(quantized) == ["layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj", "layers.0.self_attn.o_proj",
                                 "layers.0.self_attn.qkv_proj"]


def test_prefill_rows_match_the_independent_w8a8_rounding(smollm2_shaped):
    model, hf = smollm2_shaped
    torch.manual_seed(1)
    x = torch.randn(DECODE_ROWS + 7, 1536) * torch.linspace(0.1, 4.0, 1536)  # uneven column magnitudes
    down = model.layers[0].mlp.down_proj
    want = _independent_token_group_dequant(x) @ _independent_block_dequant(hf["model.layers.0.mlp.down_proj.weight"]).t()
    got = fp8_linear(x, down.weight, down.weight_scale, down.block_n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    decode = x[:W8A16_ROWS]  # W8A16 (the GEMV's rows): the activations are not rounded
    want16 = decode @ _independent_block_dequant(hf["model.layers.0.mlp.down_proj.weight"]).t()
    torch.testing.assert_close(fp8_linear(decode, down.weight, down.weight_scale, down.block_n), want16,
                               rtol=1e-5, atol=1e-5)
