"""dpzoo inside the tools people already train with: PEFT (DP-LoRA), the Hugging Face Trainer,
Opacus. Each integration is its own module and imports its library only when used."""
