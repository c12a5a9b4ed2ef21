"""Every way the package starts ranks, and what each worker process shares.

- ``standalone``: ``zeppelin train``'s launcher, N worker processes started as
  ``torchrun --standalone`` starts them, ended together;
- ``worker``: how one of those workers starts and ends (its outcome file, its log);
- ``ranks``: a function run on N fresh processes that form one gloo group
  (``run_distributed``), for ``verify``, ``check``, ``profile`` and ``validate-cost-model``;
- ``preload``: what that runner's fork server imports once; ``quiet``: the third-party warnings
  every worker hides unless asked.
"""
