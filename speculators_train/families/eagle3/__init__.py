"""EAGLE-3: fused target states + one Llama decoder layer, trained with training-time test."""
