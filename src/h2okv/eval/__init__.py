"""Accuracy evaluations, as library functions that take plain parameters (models, lists, numbers)
and return rows; ``h2okv eval <kind>`` parses its options in ``h2okv.cli.eval.<kind>`` and calls them."""
