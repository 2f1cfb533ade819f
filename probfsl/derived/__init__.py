"""Inference derived from each method's declaration.

Every method of the five papers is declared as a plain Pyro model (its module's
``*_model`` function). With ``engine="derived"`` an estimator does not run its
hand-written updates: it hands that declaration and its data to variational message
passing (:mod:`probfsl.inference.vmp`), which derives the updates, and reads the answer
off the factors it returns. One module per method, which also registers the method's two
engines side by side (``ENGINES``, keyed ``"handwritten"`` and ``"derived"``: the
estimator picks ``ENGINES[engine]``; docs/design/engine.md §1.1):

* :mod:`probfsl.derived.bavardage`: the VB Gaussian mixture of BAVARDAGE (Hu et al.,
  AISTATS 2023), with the adaptive PLDA projection as a point-estimated linear map
  updated between blocks of VB updates (the paper's schedule, Algorithm 1).
* :mod:`probfsl.derived.slem`: the posterior mean of the Gaussian linear model whose
  MAP is the square-loss exemplar machine (Rezende et al., CVPR 2017).
* :mod:`probfsl.derived.em_dirichlet`: the mixture of Dirichlet laws of EM-Dirichlet
  (Martin et al., CVPR 2024).
* :mod:`probfsl.derived.evidence`: Bayesian linear regression on one-vs-rest targets with
  the type-II (evidence) penalty (Kim et al., CVPR 2016).
* :mod:`probfsl.derived.gp_tree`: GP-Tree's nodes (Achituve et al., ICML 2021).
"""
