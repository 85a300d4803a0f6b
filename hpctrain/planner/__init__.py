"""`hpctrain plan`: predicts, before any GPU time is spent, what a parallel layout of a config costs per GPU (memory,
step time, throughput, MFU) and what its checkpoints cost (size, save and load time, the best interval), from the
model's dimensions, hardware profiles and measured bandwidths; it can rank every layout that fits the allocation.
"""
