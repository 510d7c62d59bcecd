"""The ``qir`` command line."""
