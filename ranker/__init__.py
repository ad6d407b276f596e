"""The output-length ranker: features, model, online training, evaluation, and the dispatch
and ordering algorithms that use its predictions."""
