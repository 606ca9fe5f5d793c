"""shardtune: fine-tune large language models with LoRA, QLoRA, DoRA or full SFT on PyTorch FSDP2."""

__version__ = "0.1.0"
