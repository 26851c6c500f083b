"""Quick answers from web server access logs."""
