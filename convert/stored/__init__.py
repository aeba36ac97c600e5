"""How quantized checkpoints store their weights, one module per storage format, below the checkpoint reader:
the reader (``convert.checkpoint``) sizes and decodes with these facts, and the writers (``awq``, ``mlx``) pack
with the same ones. Nothing here imports the rest of ``convert`` but its errors.

- ``int4``: 4-bit nibbles packed in int32 (compressed-tensors ``pack-quantized``, AutoAWQ GEMM);
- ``mlx``: mlx-lm's affine groups packed in uint32 beside their scales and biases;
- ``mxfp4``: OCP microscaling FP4 (E2M1 values in blocks of 32 sharing an E8M0 scale), as gpt-oss ships its
  experts;
- ``methods``: what a ``quantization_config`` says, named the way users know it (bitsandbytes, GPTQ, ...).
"""
