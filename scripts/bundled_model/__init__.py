"""Training the bundled flare-tiny pair (issue 7): corpus, tokenizer, models, training, evaluation.

``scripts/train_bundled_model.py`` is the command; each module here is one step of it.
"""
