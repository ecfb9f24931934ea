"""Model preparation: import the default (or a user's) models into the BentoML store.

Run ``python -m models.import_models --help``. The service only reads what this
writes.
"""
