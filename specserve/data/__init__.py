"""Offline data both training and the benchmarks read: the corpus, prompt sets, the zoo's
layout."""
