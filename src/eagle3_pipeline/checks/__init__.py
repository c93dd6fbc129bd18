"""The checks room: numeric checks more than one stage runs (verify on extracted records, train on its
online rows): final_layer (a record's last layer against the target's own logits) and layer_identity
(which decoder layer a stored state came from).
"""
