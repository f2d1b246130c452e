"""One pipeline under every loader: stages with one contract (:mod:`.stage`), the one background
hand-off (:mod:`.prefetch` over :mod:`.handoff`), one checkpoint format (:mod:`.checkpoint`) and
elastic-resume arithmetic (:mod:`.elastic`). Imports only the standard library, numpy and torch.
"""
