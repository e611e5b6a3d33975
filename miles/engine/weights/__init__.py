"""The served weights and every change to them."""
