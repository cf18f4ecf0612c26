"""Everything that maps the model onto ranks; the only package that communicates."""
