"""A trained detector at work: the predictor, COCO evaluation, the exported artifact, drawing."""
