"""The training-while-serving demo: a controller, a trainer and user traffic on one machine."""
