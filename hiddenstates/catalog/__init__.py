"""hiddenstates.catalog"""
