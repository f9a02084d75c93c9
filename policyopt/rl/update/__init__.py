"""The jitted side of training: the learner's steps (`learner`), the critic (`critic`), the
method-specific steps (`methods`), the batch's forwards, packing and micro-batches, MoE
routing metrics (`routing`), LoRA weights (`adapters`)."""
