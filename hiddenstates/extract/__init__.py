"""hiddenstates.extract"""
