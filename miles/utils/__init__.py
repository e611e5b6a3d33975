"""Small building blocks shared by every part of miles."""
