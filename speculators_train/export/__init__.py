"""Export: a trained draft written in one of its family's formats, with the tokenizer and a card."""
