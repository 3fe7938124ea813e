"""Scripts that are not runtime code: training the embedded tiny pairing."""
