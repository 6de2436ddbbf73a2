"""DSpark: DFlash's block drafting with every slot proposing, a Markov head that biases each slot by the token before
it, and a confidence head that predicts each slot's acceptance."""
