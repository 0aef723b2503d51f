"""Training compute: the model, data, one stage's forward/backward/optimizer, devices, the reference trainer."""
