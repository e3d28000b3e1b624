"""Privacy accounting: :mod:`~dpzoo.privacy.accounting.accountant` (``Accountant``, σ for a target
ε), :mod:`~dpzoo.privacy.accounting.registry` (``register_accountant``, the specs) and
:mod:`~dpzoo.privacy.accounting.backends` (dp-accounting and Opacus' accountants). The public names
are re-exported by :mod:`dpzoo.privacy`.
"""
