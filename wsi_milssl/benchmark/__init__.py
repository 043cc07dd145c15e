"""The MIL benchmarks: everything that measures MIL-SSL against other methods, kept apart from the
method itself (:mod:`wsi_milssl.mil`).

- :mod:`wsi_milssl.benchmark.mil_csv` — nested cross-validation on the classical MIL CSVs (MUSK1,
  MUSK2, ELEPHANT, UCSB breast cancer): ``wsi-milssl benchmark mil-csv``.
- :mod:`wsi_milssl.benchmark.bags` — the paper's digit-bag protocols (normal, hard, ablation):
  ``wsi-milssl benchmark bags``.
- :mod:`wsi_milssl.benchmark.stacked` — many small MIL models (MIL-SSL and the baselines) trained at once,
  one leading model axis: the grid points and folds of one nested-CV split.
- :mod:`wsi_milssl.benchmark.baselines` — ABMIL, gated ABMIL and max-pooling MIL, and the digit CNN.
- :mod:`wsi_milssl.benchmark.digits` — digit images (bundled 8 x 8, MNIST IDX files) and the bags
  built from them.

The speed benchmarks of the slide stages are scripts in the repository's ``benchmarks/`` folder.
"""
