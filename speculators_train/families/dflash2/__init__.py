"""DFlash2: DFlash with grouped dynamic convolutions across a block's slots around each sublayer, and a candidate
selector that reranks each slot's top-k by its transition from the token before."""
