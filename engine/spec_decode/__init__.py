"""Speculative decoding by prompt lookup (vLLM's "ngram" method), in three pieces:

- ``config.py``: ``SpeculativeConfig``, vLLM's ``speculative_config`` names, defaults and checks;
- ``drafter.py``: the scheduler's half: which decoding sequences get draft tokens this step,
  how many (``ngram_proposer.py`` finds them), and the drafted / accepted counts;
- ``verifier.py``: the runner's half: a target token at every verified position, the
  drafts that agree with them kept, plus one.

Kept light on purpose: ``engine.config`` imports ``config.py`` without torch or numpy.
"""
