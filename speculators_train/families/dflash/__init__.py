"""DFlash: block-diffusion drafting, a block of draft tokens from one forward over [anchor, mask x (B - 1)]."""
