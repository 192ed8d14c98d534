"""Which format the weights are loaded in, from `--quantization` and what the machine can run.

| --quantization | float weights (HF, F16/BF16 GGUF) | a GGUF's quantized weights             |
| -------------- | --------------------------------- | -------------------------------------- |
| auto (default) | --dtype                           | their own format where quant_linear    |
|                |                                   | runs it, else dequantized (with a note) |
| int8 / int4    | quantized at load                 | an error: they are quantized already   |
| none           | --dtype                           | dequantized to --dtype                 |

`--dtype float32` is the float reference path: auto resolves to none under it.
"""

from __future__ import annotations

from kvserve.errors import ConfigError
from kvserve.kernels.support import KernelChoice


def resolve_quantization(requested: str, quant_kernel: KernelChoice, notes: list[str]) -> str:
    """The loader's mode ("native", "int8", "int4" or "none") for the requested name, given the
    quant_linear verdict for this dtype, device and CPU (KernelSupport.quant_linear_choice)."""
    if requested == "none":
        return "none"
    if requested == "auto":
        if quant_kernel.enabled:
            return "native"
        notes.append(f"quantized weights are dequantized at load: quant_linear is off ({quant_kernel.reason})")
        return "none"
    if not quant_kernel.enabled:
        raise ConfigError(
            "quantization", f"{requested} needs kvserve's quant_linear CPU kernel, which is off here: {quant_kernel.reason}"
        )
    return requested
