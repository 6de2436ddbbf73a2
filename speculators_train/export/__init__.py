"""Export: a trained draft written in one of its family's layouts, with the tokenizer and a card."""
