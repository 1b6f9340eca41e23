"""What the dry-run knows of torchvision's models without torchvision (a login node's bare
Snakemake environment), their one home: the names (``list_models(module=torchvision.models)``
of the pinned torchvision, held equal to the installed one by tests/test_run_checks.py) and
the facts the meta-device check finds again with torch (imagenet_ddp.models).
"""

TORCHVISION_VERSION = "0.29.1"

CLASSIFICATION_MODELS = frozenset((
    "alexnet", "convnext_base", "convnext_large", "convnext_small", "convnext_tiny",
    "densenet121", "densenet161", "densenet169", "densenet201", "efficientnet_b0",
    "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4",
    "efficientnet_b5", "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_l",
    "efficientnet_v2_m", "efficientnet_v2_s", "googlenet", "inception_v3", "maxvit_t",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
    "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_16gf", "regnet_x_1_6gf",
    "regnet_x_32gf", "regnet_x_3_2gf", "regnet_x_400mf", "regnet_x_800mf", "regnet_x_8gf",
    "regnet_y_128gf", "regnet_y_16gf", "regnet_y_1_6gf", "regnet_y_32gf", "regnet_y_3_2gf",
    "regnet_y_400mf", "regnet_y_800mf", "regnet_y_8gf", "resnet101", "resnet152", "resnet18",
    "resnet34", "resnet50", "resnext101_32x8d", "resnext101_64x4d", "resnext50_32x4d",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0",
    "squeezenet1_0", "squeezenet1_1", "swin_b", "swin_s", "swin_t", "swin_v2_b", "swin_v2_s",
    "swin_v2_t", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19",
    "vgg19_bn", "vit_b_16", "vit_b_32", "vit_h_14", "vit_l_16", "vit_l_32", "wide_resnet101_2",
    "wide_resnet50_2",
))  # fmt: skip

# Builders whose model class takes zero_init_residual (torchvision's ResNet family).
RESIDUAL_BN = ("resnet", "resnext", "wide_resnet")
# Models returning a named tuple (the auxiliary classifiers' outputs too) in training.
AUX_OUTPUTS_IN_TRAINING = ("googlenet", "inception_v3")
# Adaptive average pooling to more than 1x1 (vgg, alexnet) has no deterministic CUDA backward:
# torch raises at the first backward on the GPU (the CPU's is deterministic).
NONDETERMINISTIC_ON_CUDA = ("vgg", "alexnet")
