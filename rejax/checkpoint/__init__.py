"""Hugging Face checkpoints (bf16 safetensors, ModelOpt NVFP4) <-> rejax `Params`.

The HF-name <-> weights-pytree mapping lives only here. `load` reads an HF model directory:

    config.json                      required; `model_type` qwen3 | qwen2
    model.safetensors                or model.safetensors.index.json + the shards it names
    tokenizer.json                   optional (+ tokenizer_config.json / chat_template.jinja)
    generation_config.json           optional
    hf_quant_config.json             optional; ModelOpt NVFP4 (also `quantization_config` in
                                     config.json)

Quantization modes (`quant`):
    bf16 checkpoint, quant=None            float linears in `dtype`
    bf16 checkpoint, quant="nvfp4"         every decoder linear quantized offline with
                                           `nvfp4.quantize_weight` (ModelOpt-exact); W4A4 with
                                           no `input_scale` (per-row dynamic activation global
                                           scale) until `rejax.calibrate_input_scales` sets one
    bf16 checkpoint, quant="nvfp4-w4a16"   same weights, bf16 activations
    NVFP4 checkpoint, quant=None           the checkpoint's own mode (NVFP4 -> W4A4 with its
                                           static input_scales; W4A16_NVFP4 -> W4A16)
    NVFP4 checkpoint, quant=<other NVFP4>  same weight bytes, only the activation mode changes:
                                           W4A4 -> W4A16 drops input_scale; W4A16 -> W4A4 runs
                                           with dynamic activation scales (both logged)
NVFP4 weights are never dequantized and re-quantized: a ModelOpt tensor's bytes are kept.

ModelOpt NVFP4 tensors per quantized linear `p` (checked on load, written by `save`):
    p.weight          uint8 [N, K/2]   element 2j in the low nibble of byte j, 2j+1 in the high
                                       nibble (ModelOpt's `NVFP4QTensor` packing, the same as
                                       `Nvfp4Tensor.packed`, so bytes are copied untouched)
    p.weight_scale    float8_e4m3fn [N, K/16] (uint8 accepted and reinterpreted bit for bit)
    p.weight_scale_2  float32 [] or [1] -> Nvfp4Tensor.global_scale f32 []; written as []
    p.input_scale     float32 [] or [1] -> f32 [] (W4A4 static); written as []
    p.bias            optional, float
Excluded modules (`exclude_modules` / `ignore`, fnmatch patterns) stay float; lm_head and the
embedding are always float. FP8 KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`) are
dropped with a warning: rejax keeps the KV cache in bf16.

Layout: every layer's tensors of one kind are stacked ([L, ...], rejax/params.py), and q/k/v and
gate/up are fused into one linear each (rows concatenated, bytes unchanged). Each NVFP4 shard
keeps its own `weight_scale_2` exactly (one global scale per row when they differ) and its own
`input_scale` (one per layer when the shards agree, as ModelOpt exports them; else one per
shard, and activations are quantized once per shard scale); nothing is re-quantized, and `save`
splits every stack and fused linear back into the HF tensors with the same bytes. A
ModelOpt `exclude_modules` pattern must keep a fused linear float in every layer or in none
(a mix cannot be stacked and is refused with a message naming the modules).

W4A4 with dynamic activation scales has no `input_scale` tensors; `save` marks it with
`input_activations.dynamic = true` in config.json's `quantization_config` (the
compressed-tensors field), which `load` reads back. Without that flag a missing `input_scale`
on an NVFP4 checkpoint is an error.
"""

from rejax.checkpoint.files import CheckpointFileNotFoundError
from rejax.checkpoint.reader import load
from rejax.checkpoint.writer import save

__all__ = ["CheckpointFileNotFoundError", "load", "save"]
