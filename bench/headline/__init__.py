"""The headline benchmark: scheduled vs random vs rank-order placement of real peers on an emulated network."""
