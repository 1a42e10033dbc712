"""Checkpoint loading: model resolution, GGUF and safetensors readers, the converted-checkpoint cache."""
