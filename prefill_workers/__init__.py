"""prefill_workers"""
