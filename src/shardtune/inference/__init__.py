"""Generating with a trained model: a base with its adapter, or a merged model."""
