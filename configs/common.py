"""What the recipes in configs/ share; not a recipe itself (no get_config).

Every recipe builds on this module only, one level deep: `base_config()`
holds every key the library reads with its default value (a recipe
overrides values but never drops a key), and the builders below make the
blocks several recipes use. No recipe imports another, so reading one recipe
and this file tells everything it sets.
"""

import ml_collections

# Logical axis -> mesh axes, for every model in the project (names a model
# does not use are ignored).
#  * Batch over data x fsdp: both axes are data parallel for activations.
#  * Conv kernels split their output channels over fsdp x model: FSDP
#    gathers them on use, and `model` splits each layer's output channels
#    (tensor parallel), matching the activations' `channels` rule. Input
#    channels stay whole: XLA (jax 0.10, both partitioners) computes wrong
#    kernel gradients for conv kernels split on both dimensions on a mesh
#    with data, fsdp and model all > 1; tests compare against one device.
#  * ViT: matmul kernels' model width on fsdp (ZeRO-3: gathered on use);
#    heads and MLP hidden units on model (Megatron). Width-sized vectors
#    (LayerNorm, output biases) only on fsdp: split over model, XLA would
#    propagate their split into the residual stream and gather it back
#    before every matmul.
SHARDING_RULES = (
    ("batch", ("data", "fsdp")),
    ("height", None),
    ("width", None),
    ("channels", "model"),
    ("kernel_h", None),
    ("kernel_w", None),
    ("conv_in", None),
    ("conv_out", ("fsdp", "model")),
    ("stages", None),
    ("layers", None),
    ("embed", "fsdp"),
    ("heads", "model"),
    ("kv", None),
    ("mlp", "model"),
    ("norm", "fsdp"),
    ("tokens", None),
    ("act_embed", None),
    ("act_heads", "model"),
    ("act_mlp", "model"),
)


def resnet_backbone(
    stage_sizes: tuple[int, ...],
    width: int,
    block: str,
    *,
    norm: str = "group",
    freeze_stages: int = 0,
    pretrained: str = "",
    training: str = "full",
) -> ml_collections.ConfigDict:
    """`config.model.backbone` for a ResNet (`block`: "basic" or "bottleneck"), with an FPN neck.

    * norm: "group" (GroupNorm, trained: for training from scratch at a few
      images per device) or "frozen_bn" (BatchNorm with its statistics and
      affine fixed, detectron2's FrozenBatchNorm2d: to fine-tune ImageNet
      weights, whose statistics batches this small cannot re-estimate).
    * freeze_stages: leading stages the optimizer keeps fixed, detectron2's
      FREEZE_AT: 0 none, 1 the stem, 2 the stem and the first residual stage
      (detectron2's choice with pretrained weights), ..., 5 all of a ResNet-50.
    * pretrained: backbone weights to start from, "" for none: a torchvision
      ResNet state dict (.pth/.pt/.safetensors/.npz) or the .npz that
      `python -m detector.convert_pretrained` writes (BatchNorm weights: norm="frozen_bn").
    * training: "full" (the backbone trains, within freeze_stages) or
      "frozen" (it runs forward only: no gradient, optimizer state or EMA;
      the neck and head train). "lora" is for a ViT's adapters only.
    """
    return ml_collections.ConfigDict(
        dict(
            name="resnet",
            stage_sizes=stage_sizes,
            width=width,
            block=block,
            norm=norm,
            freeze_stages=freeze_stages,
            pretrained=pretrained,
            training=training,
        )
    )


def vit_backbone(
    embed_dim: int,
    depth: int,
    num_heads: int,
    *,
    window_size: int = 14,
    global_attention_every: int,
    pretrain_image_size: int = 224,
    pretrained: str = "",
    **options,
) -> ml_collections.ConfigDict:
    """`config.model.backbone` for a ViT (4 global blocks for the ViTDet sizes); the defaults are the plain ViT/16.

    `pretrained`: backbone weights to start from, "" for none: a timm ViT
    state dict (.pth/.pt/.safetensors/.npz: MAE, DeiT, DINOv2, DINOv3, EVA-02)
    or a transformers Dinov2Model/DINOv3ViTModel one, the .npz that
    `python -m detector.convert_pretrained` makes of one, or a flat .npz in this
    project's parameter layout; see `vitdet_coco`. `options` override the
    foundation-backbone keys below (see `detector.models.vit.ViT`), e.g. for
    DINOv3 ViT-L: patch_size=16, absolute_position=False, rope="dinov3",
    rope_temperature=100.0, class_token=True, register_tokens=4,
    layer_scale=1e-5, qkv_bias="none", norm_epsilon=1e-5; for timm's EVA-02 as
    registered (no `norm.*`, `fc_norm` after pooling): final_norm=False (prefix tokens need
    global_attention_every=1; with windows set class_token=False,
    register_tokens=0 and the importer drops them).
    """
    keys = dict(
        patch_size=16,
        absolute_position=True,
        rope="",
        rope_temperature=10000.0,
        rope_reference_grid=0,
        class_token=False,
        register_tokens=0,
        layer_scale=0.0,
        mlp="gelu",
        mlp_hidden=0,
        mlp_norm=False,
        qkv_bias="all",
        norm_epsilon=1e-6,
        final_norm=True,
        lora_rank=0,
        lora_alpha=1.0,
        training="full",
    )
    unknown = sorted(set(options) - set(keys))
    if unknown:
        raise TypeError(f"vit_backbone got unknown options {unknown}; known: {sorted(keys)}")
    keys.update(options)
    return ml_collections.ConfigDict(
        dict(
            name="vit",
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=4.0,
            window_size=window_size,
            global_attention_every=global_attention_every,
            pretrain_image_size=pretrain_image_size,
            scan=True,
            pretrained=pretrained,
            **keys,
        )
    )


def dinov3_backbone(
    embed_dim: int,
    depth: int,
    num_heads: int,
    *,
    mlp: str = "gelu",
    mlp_hidden: int = 0,
    training: str = "full",
    lora_rank: int = 16,
    pretrained: str = "",
) -> ml_collections.ConfigDict:
    """`config.model.backbone` for a DINOv3 ViT/16 as released (Simeoni et al. 2025).

    LayerScale (1e-5 at initialisation), a class token and 4 registers, 2-D
    RoPE (temperature 100, coordinates in [-1, 1]) and no absolute position
    embedding, no qkv bias, LayerNorm eps 1e-5, global attention in every
    block. ViT-S/B/L: `mlp="gelu"` (x4); 7B: `mlp="swiglu", mlp_hidden=8192`.
    `training`: 'full', 'frozen' or 'lora' (rank `lora_rank` adapters on
    qkv, the out-projection and both MLP matrices, alpha = rank: scale 1).
    """
    return vit_backbone(
        embed_dim,
        depth,
        num_heads,
        window_size=0,
        global_attention_every=1,
        pretrained=pretrained,
        absolute_position=False,
        rope="dinov3",
        rope_temperature=100.0,
        class_token=True,
        register_tokens=4,
        layer_scale=1e-5,
        mlp=mlp,
        mlp_hidden=mlp_hidden,
        qkv_bias="none",
        norm_epsilon=1e-5,
        lora_rank=lora_rank if training == "lora" else 0,
        lora_alpha=float(lora_rank),
        training=training,
    )


def dino_model(
    *,
    hidden_dim: int = 256,
    num_heads: int = 8,
    ffn_dim: int = 2048,
    encoder_layers: int = 6,
    decoder_layers: int = 6,
    num_queries: int = 900,
    denoising_pairs: int = 100,
    one_to_many_queries: int = 0,
    one_to_many_repeats: int = 6,
) -> ml_collections.ConfigDict:
    """`config.model.dino`: the DINO-4scale transformer (Zhang et al. 2022), read when `model.name == "dino"`.

    The defaults are the paper's: 256 wide, 8 heads, FFN 2048, 6 encoder and
    6 decoder layers, 4 pyramid levels (strides 8-64) with 4 sampling points
    per head and level, 900 queries. Denoising: DINO's `dn_number` of 100
    positive-negative pairs per image, filled with whole groups of a
    positive and a negative noised copy of each of the image's n boxes (100 // n
    groups, at least one; 2 max(pairs, input.max_boxes) static query slots),
    labels flipped with probability label_noise_ratio / 2, box corners moved
    by up to box_noise_scale half sizes (negatives by 1-2x that). 0: off.
    Hybrid one-to-many branch (H-DETR, Jia et al. 2023; training only): M =
    one_to_many_queries more queries, seen by no other, matched one-to-one to
    the ground truth repeated one_to_many_repeats times, so each box gets that
    many positives (H-DETR's COCO recipe: 1500 queries, 6 repeats). 0: off.
    Distinct queries (DDQ, Zhang et al. 2023): the encoder proposals that
    overlap a better-scoring one by more than distinct_query_iou (class-
    agnostic NMS) are chosen only after every distinct one, in training and
    prediction alike, so each object starts with one query instead of
    several neighbours (DDQ: 0.8). 0: off, DINO's plain top-N.
    Instance masks (Mask DINO, Li et al. 2023): mask_dim > 0 adds the mask
    branch (a pixel embedding at stride 4 and each query's mask embedding of
    that width; Mask DINO: 256) and the mask terms of the matching cost and
    the set loss (`config.loss.set_prediction`'s mask keys); it needs
    input.mask_stride = 4 (a ViT's map is brought to stride 4 by ViTDet's
    transposed convolutions). 0: boxes only. Mask-enhanced anchors (Mask DINO's
    box initialisation): the one-to-one queries start from the tight boxes of
    their selected proposals' masks instead of the proposals' boxes (where a
    mask is empty, the box); needs mask_dim > 0.
    """
    return ml_collections.ConfigDict(
        dict(
            hidden_dim=hidden_dim,
            num_heads=num_heads,
            ffn_dim=ffn_dim,
            encoder_layers=encoder_layers,
            decoder_layers=decoder_layers,
            num_points=4,
            min_level=3,
            max_level=6,
            num_queries=num_queries,
            denoising_pairs=denoising_pairs,
            one_to_many_queries=one_to_many_queries,
            one_to_many_repeats=one_to_many_repeats,
            distinct_query_iou=0.0,
            label_noise_ratio=0.5,
            box_noise_scale=1.0,
            mask_dim=0,
            mask_enhanced_anchors=False,
        )
    )


def base_config() -> ml_collections.ConfigDict:
    """Every key the library reads, at its default: a tiny RetinaNet on the embedded synthetic shapes."""
    config = ml_collections.ConfigDict()
    config.seed = 0

    # Mesh: -1 fills the devices the other axes leave. The global batch is
    # split over data x fsdp; parameters over fsdp (and model, where the rules say).
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1))
    config.sharding = ml_collections.ConfigDict()
    config.sharding.rules = SHARDING_RULES
    # Spatial partitioning for conv detectors at high resolution: image height
    # (and every conv activation after it) is split over `model` instead of
    # channels; XLA exchanges the halo rows each convolution needs.
    config.sharding.spatial_partitioning = False

    config.dataset = ml_collections.ConfigDict()
    # synthetic_shapes (generated here), coco_json (a COCO-format folder),
    # coco/2017, voc/2007 or voc/2012 (TFDS, prepared in data_dir).
    config.dataset.name = "synthetic_shapes"
    config.dataset.data_dir = ml_collections.FieldReference(None, field_type=str)
    # Where sources are converted once to random-access records; None: DATA_DIR/prepared.
    config.dataset.cache_dir = ml_collections.FieldReference(None, field_type=str)
    # Worker processes per host converting a COCO-format folder into records
    # (0: min(CPU cores, 8)); every host of a multi-host launch converts a share.
    config.dataset.prepare_workers = 0
    config.dataset.train_split = "train"  # TFDS split names
    config.dataset.eval_split = "validation"
    # coco_json: instances JSON and image root of each split.
    config.dataset.train_json = ml_collections.FieldReference(None, field_type=str)
    config.dataset.train_images = ml_collections.FieldReference(None, field_type=str)
    config.dataset.eval_json = ml_collections.FieldReference(None, field_type=str)
    config.dataset.eval_images = ml_collections.FieldReference(None, field_type=str)
    # Train on images without objects too (negatives), as detectron2 does by default.
    config.dataset.include_negatives = True
    # synthetic_shapes sizes.
    config.dataset.num_train_examples = 4096
    config.dataset.num_eval_examples = 256
    config.dataset.image_size = 128

    config.input = ml_collections.ConfigDict()
    config.input.image_size = (128, 128)
    config.input.max_boxes = 16
    config.input.scale_jitter = (0.75, 1.25)
    config.input.horizontal_flip = True
    config.input.mean_rgb = (123.675, 116.28, 103.53)
    config.input.std_rgb = (58.395, 57.12, 57.375)
    config.input.min_box_size = 2.0
    # Boxes the crop leaves less than this fraction of are dropped.
    config.input.min_visible_fraction = 0.0
    config.input.color_jitter = 0.0  # strength 0-1 of brightness/contrast/saturation jitter
    # DEIM's dense one-to-one input: this fraction of the training examples
    # are 2 x 2 mosaics of four (each tile scale-jittered at half the size),
    # for the first mosaic_until of total_steps; the rest of the run trains
    # on single images, as DEIM stops its mosaics for the last epochs. 0: off.
    # A mosaic decodes four images on the host, and an undecodable one masks
    # every mosaic it is drawn into (counted against max_bad_fraction).
    config.input.mosaic_probability = 0.0
    config.input.mosaic_until = 0.5
    # Training ships the decoded pixels a crop window needs and the train step
    # resizes them on the device (DALI-style), where resizing on the host is
    # the costliest part of large-scale jitter; needs color_jitter 0.
    config.input.resize_on_device = False
    # (H, W) of those shipped sources, at least image_size; None: image_size.
    # A window whose source pixels do not fit is resized on the host, so a
    # dataset of images larger than image_size wants it larger (e.g. 1344 for
    # 1333 px images at 1024).
    config.input.source_size = ml_collections.FieldReference(None, field_type=tuple)
    # Stop instead of training on what is left when more than this fraction of
    # the images cannot be used.
    # Instance masks in the training batches: each box's mask rasterised in
    # the network geometry at this stride (network pixels per mask cell),
    # bit-packed (`input_pipeline.masks`). 0: no masks (box-only training).
    config.input.mask_stride = 0
    config.input.max_bad_fraction = 0.5
    config.input.prefetch = 2
    # tf.data threads per process; None: half the host's cores, at most 16.
    config.input.num_threads = ml_collections.FieldReference(None, field_type=int)

    config.model = ml_collections.ConfigDict()
    # The detector family: "retinanet" (dense anchors + NMS; the keys below up
    # to `anchors`) or "dino" (queries + set losses; `model.dino`).
    config.model.name = "retinanet"
    config.model.dtype = "float32"  # compute dtype: "bfloat16" for mixed precision (params stay float32)
    config.model.remat = "none"  # per-block rematerialisation: "none", "full" or "dots"
    config.model.backbone = resnet_backbone((1, 1, 1, 1), 16, "basic")
    config.model.fpn_features = 64
    config.model.head_convs = 2
    config.model.head_features = 64
    # Normalisation in the head's towers: "group" (GroupNorm, per pyramid
    # level) or "none" (the original RetinaNet's, torchvision's and
    # detectron2's head: convolutions with biases only).
    config.model.head_norm = "group"
    # Run the head's shared convs on one canvas of all pyramid levels: one
    # kernel-gradient reduction across data-parallel devices per conv instead
    # of one per level, for ~14% more pixels and packing copies. "auto" packs
    # when training with the batch split over >1 device (mesh data x fsdp),
    # never when predicting; "always" / "never" force it. The parameters and
    # outputs are the same either way.
    config.model.head_level_packing = "auto"
    config.model.anchors = ml_collections.ConfigDict(
        dict(min_level=3, max_level=5, num_scales=3, aspect_ratios=(0.5, 1.0, 2.0), anchor_size=2.0)
    )

    config.model.dino = dino_model()

    config.loss = ml_collections.ConfigDict()
    config.loss.positive_iou = 0.5
    config.loss.negative_iou = 0.4
    config.loss.allow_low_quality_matches = True
    config.loss.focal_alpha = 0.25
    config.loss.focal_gamma = 2.0
    config.loss.box_loss = "giou"
    config.loss.huber_delta = 0.1
    config.loss.box_loss_weight = 1.0
    config.loss.box_coder_weights = (1.0, 1.0, 1.0, 1.0)
    # DINO's set losses (focal_alpha/gamma above are shared): the weights of
    # the class, L1 and GIoU terms on matched queries, and of the same three
    # in the Hungarian matching cost (whose class cost stays focal). The class
    # loss: "focal" (DINO's), "varifocal" (RT-DETR's: the positive's target
    # is its box's IoU with the ground truth) or "mal" (DEIM's
    # matchability-aware loss: target IoU**mal_gamma, weight 1).
    config.loss.set_prediction = ml_collections.ConfigDict(
        dict(
            class_weight=1.0,
            l1_weight=5.0,
            giou_weight=2.0,
            match_class_weight=2.0,
            match_l1_weight=5.0,
            match_giou_weight=2.0,
            class_loss="focal",
            varifocal_alpha=0.75,
            varifocal_gamma=2.0,
            mal_gamma=1.5,
            # The hybrid branch's loss (model.dino.one_to_many_queries), divided
            # by the repeated boxes' count, times this (H-DETR's lambda).
            one_to_many_weight=1.0,
            # Masks (model.dino.mask_dim > 0; Mask DINO's COCO weights): sigmoid
            # BCE and dice on mask_points points per matched mask, a fraction
            # mask_importance_ratio of them the most uncertain of
            # mask_oversample_ratio x mask_points uniform candidates, the rest
            # uniform (Mask2Former's 112 x 112 = 12,544, 3, 0.75); the matching
            # cost compares every query at mask_points uniform points per image.
            mask_weight=5.0,
            dice_weight=5.0,
            match_mask_weight=5.0,
            match_dice_weight=5.0,
            mask_points=12544,
            mask_oversample_ratio=3.0,
            mask_importance_ratio=0.75,
        )
    )

    # RetinaNet: the pre_nms_top_k best (anchor, class) scores above
    # score_threshold, class-aware NMS at iou_threshold, max_detections kept.
    # DINO: the max_detections best (query, class) scores, no NMS unless
    # query_nms_iou_threshold > 0 (the reference DINO's nms_iou_threshold;
    # then class-aware NMS over the pre_nms_top_k best pairs removes the
    # duplicates a briefly trained set predictor still makes).
    config.postprocess = ml_collections.ConfigDict(
        dict(
            pre_nms_top_k=1000,
            score_threshold=0.05,
            iou_threshold=0.5,
            max_detections=100,
            query_nms_iou_threshold=0.0,
        )
    )

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 2e-3
    config.optimizer.schedule = "cosine"  # or "step": x0.1 at each of decay_boundaries
    config.optimizer.decay_boundaries = ()
    config.optimizer.momentum = 0.9
    config.optimizer.weight_decay = 1e-4
    config.optimizer.warmup_steps = 100
    config.optimizer.grad_clip_norm = 1.0
    # Learning-rate multipliers by parameter path ('/'-joined, e.g.
    # "backbone/stage1_block1/Conv_0/kernel"): ((regex, multiplier), ...), the
    # first full match wins; DETR recipes train the backbone at x0.1 with
    # (("backbone/.*", 0.1),). Frozen parameters stay frozen whatever the multiplier.
    config.optimizer.lr_multipliers = ()
    # ViTDet's layer-wise decay for a ViT backbone: block i (0-based) trains at
    # layer_decay ** (depth - i), the patch and position embeddings at
    # layer_decay ** (depth + 1), everything above the blocks at x1. 1.0: off.
    config.optimizer.layer_decay = 1.0
    # Micro-batches per optimizer update: global_batch_size / accumulate_steps
    # examples go through the network at a time (a scan inside the one compiled
    # step) and their gradients are summed, so a recipe's global batch runs on
    # fewer devices with the same update. Steps, the schedule, logs and
    # checkpoints count updates.
    config.optimizer.accumulate_steps = 1
    # Exponential moving average of the parameters, kept in the train state
    # and checkpointed; evaluation, the best checkpoint, evaluate/predict/export
    # and WORKDIR/export/params use it when on. 0.0: off. With ema_warmup the
    # decay at update t is min(ema_decay, (1 + t) / (10 + t)), so the average
    # forgets its random start quickly.
    config.optimizer.ema_decay = 0.0
    config.optimizer.ema_warmup = True

    # Start a new run from another run's parameters (its WORKDIR): every
    # parameter whose path and shape match is loaded, the rest initialised and
    # listed in the log; the optimizer starts afresh. Only on a fresh start: a
    # workdir with checkpoints resumes from its own. "" for none.
    config.init_from = ""

    config.global_batch_size = 16
    config.total_steps = 1500
    config.log_every_steps = 50
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    config.keep_checkpoints = 3
    # The evaluation metric WORKDIR/best keeps the highest of: "AP" (box), or
    # with masks (model.dino.mask_dim > 0) "mask_AP"; any COCO stat name works
    # ("AP50", "mask_AP75", ...).
    config.best_metric = "AP"
    # Steps with a non-finite loss or gradient are skipped on device and counted;
    # this many in a row stop training with an error (0: never stop).
    config.max_consecutive_nonfinite = 10
    config.eval_batch_size = 32
    # Validation images shown in TensorBoard at every evaluation (predictions |
    # ground truth); the first ones of the eval split, the same every time.
    config.eval_pictures = 4
    # Score evaluations (COCO AP on process 0) in a background thread while
    # training goes on; the metrics and the best checkpoint land at the next log
    # step, written with the step they belong to. The evaluated parameters stay
    # on the devices until then (one more copy of them). False: score in place.
    config.background_scoring = True
    return config


def coco_2017(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` (from `base_config()`) set up for COCO 2017 at 1024 px, as every COCO recipe trains.

    Inputs are padded to a static 1024x1024 (XLA needs static shapes), at
    most 100 boxes each; the full-size neck and head (256 features, 4 tower
    convs) with anchors 4x stride on P3-P7; at most 100 detections per
    image, as COCO's AP counts.
    """
    config.dataset.name = "coco/2017"
    config.dataset.eval_split = "validation"

    config.input.image_size = (1024, 1024)
    config.input.max_boxes = 100
    config.input.prefetch = 4
    # Resizing 1024 px crop windows is most of the host's work per image;
    # an accelerator does it in a fraction of a millisecond.
    config.input.resize_on_device = True

    config.model.fpn_features = 256
    config.model.head_convs = 4
    config.model.head_features = 256
    config.model.anchors.min_level = 3
    config.model.anchors.max_level = 7
    config.model.anchors.anchor_size = 4.0

    config.postprocess.pre_nms_top_k = 1000
    config.postprocess.max_detections = 100

    config.log_every_steps = 100
    config.eval_every_steps = 10_000
    return config


def vitdet_coco(backbone: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The ViTDet RetinaNet recipe on COCO 2017 for a ViT `backbone` (from `vit_backbone`).

    The ViTDet recipe (Li et al. 2022) with a RetinaNet head: 1024x1024 inputs
    with large-scale jitter (scale 0.1-2.0, crop/pad to 1024), window attention
    (14x14) with global attention in blocks spread evenly (4 of them), absolute
    position embeddings interpolated from the 224 px pretraining grid, AdamW
    (lr 1e-4, weight decay 0.1) at global batch 64 for 184k steps (~100 epochs)
    with x0.1 steps at 88.9% and 96.3%, bf16 compute with float32 parameters.

    ViTDet starts from MAE's self-supervised ImageNet-1k weights; the recipe
    leaves `model.backbone.pretrained` empty, so they are given on the command
    line after one offline conversion (torch only where a .pth is converted):

      python -m detector.convert_pretrained --input=mae_pretrain_vit_base.pth --output=vit_b_mae.npz
      python -m detector.train --config=configs/vitdet_b_coco.py ... --config.model.backbone.pretrained=vit_b_mae.npz

    Expected files: MAE's mae_pretrain_vit_base.pth / mae_pretrain_vit_large.pth
    (ViT-B/16, ViT-L/16; the decoder, if there, is dropped), or timm's
    vit_{base,large}_patch16_224.mae weights; their position embedding's 14x14
    grid is pretrain_image_size=224's, resized to the 64x64 grid of 1024 px in
    the forward pass. MAE's ViT-H (mae_pretrain_vit_huge.pth) is patch 14:
    ViTDet resized its patch-embedding kernel to 16x16, which the importer does
    not do, so it refuses that file (one line naming patch_embed.proj.weight).
    """
    config = coco_2017(base_config())

    config.model.backbone = backbone
    config.model.dtype = "bfloat16"
    config.model.remat = "none"

    config.input.scale_jitter = (0.1, 2.0)
    config.loss.box_loss = "giou"

    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-4
    config.optimizer.weight_decay = 0.1
    config.optimizer.schedule = "step"
    config.optimizer.warmup_steps = 250
    config.optimizer.decay_boundaries = (163_889, 177_546)
    config.optimizer.grad_clip_norm = 0.0

    config.global_batch_size = 64
    config.eval_batch_size = 64
    config.total_steps = 184_375
    config.checkpoint_every_steps = 2_500
    return config


def dino_vit_coco(
    backbone: ml_collections.ConfigDict, *, layer_decay: float = 1.0, backbone_lr_multiplier: float = 1.0
) -> ml_collections.ConfigDict:
    """DINO-4scale on a ViT `backbone` with the simple feature pyramid on COCO 2017, 12 epochs.

    ViTDet's recipe (`vitdet_coco`: LSJ 0.1-2.0 to 1024x1024, bf16 compute,
    AdamW lr 1e-4, weight decay 0.1, global batch 64) for 12 epochs with a
    x0.1 step at epoch 11, gradient clipping at 0.1, an EMA of the
    parameters, per-block rematerialisation and FSDP over 8, under
    configs/dino_r50_coco.py's DINO transformer. A backbone that trains in
    full gets ViTDet's layer-wise decay `layer_decay` and/or a learning-rate
    multiplier (DETR's x0.1); a frozen or LoRA one neither (its base weights
    do not train).
    """
    epoch_steps = 1_849  # 118,287 COCO train2017 images at global batch 64
    config = vitdet_coco(backbone)
    config.model.name = "dino"
    config.model.dino = dino_model()
    config.model.remat = "full"
    config.mesh.fsdp = 8

    config.optimizer.grad_clip_norm = 0.1
    if backbone.training == "full":
        config.optimizer.layer_decay = layer_decay
        if backbone_lr_multiplier != 1.0:
            config.optimizer.lr_multipliers = (("backbone/.*", backbone_lr_multiplier),)
    config.optimizer.warmup_steps = 250
    config.optimizer.decay_boundaries = (11 * epoch_steps,)
    config.optimizer.ema_decay = 0.9999

    config.postprocess.score_threshold = 0.0
    config.total_steps = 12 * epoch_steps
    config.checkpoint_every_steps = 1_000
    return config


def mask_dino_coco(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A DINO COCO recipe made Mask DINO's instance-segmentation one (Li et al. 2023): a 256-wide mask branch
    with mask-enhanced anchors, 300 queries, 9 decoder layers, class weight 4, mask BCE and dice at 5 on 12,544
    points (the defaults), masks at stride 4, the best checkpoint by mask AP. TFDS's coco/2017 has no masks: the
    data is a COCO-format folder (`--config.dataset.train_json=... --config.dataset.train_images=...`, eval_*)."""
    config.dataset.name = "coco_json"
    config.model.dino.mask_dim = 256
    config.model.dino.mask_enhanced_anchors = True
    config.model.dino.num_queries = 300
    config.model.dino.decoder_layers = 9
    config.loss.set_prediction.class_weight = 4.0
    config.loss.set_prediction.match_class_weight = 4.0
    config.input.mask_stride = 4
    config.best_metric = "mask_AP"
    return config


def tiny_dino() -> ml_collections.ConfigDict:
    """configs/dino_tiny.py: the DINO-4scale model at a size that trains in minutes on a CPU (see that file)."""
    config = base_config()
    config.model.name = "dino"
    config.model.dino = dino_model(
        hidden_dim=64,
        num_heads=4,
        ffn_dim=256,
        encoder_layers=2,
        decoder_layers=3,
        num_queries=100,
        denoising_pairs=32,  # 64 query slots for the 16 box slots, as 2 groups were
    )
    config.loss.set_prediction.class_loss = "mal"
    config.optimizer.learning_rate = 2e-3
    config.optimizer.weight_decay = 1e-4
    config.optimizer.grad_clip_norm = 0.1
    # About the default config's wall time on a 2-core CPU (DINO's step costs ~2.5x the RetinaNet's).
    config.total_steps = 600
    config.eval_every_steps = 200
    config.checkpoint_every_steps = 200
    # Top-100 over queries x classes as DINO evaluates: no score threshold.
    config.postprocess.score_threshold = 0.0
    return config


def dino_tiny() -> ml_collections.ConfigDict:
    """configs/dino_tiny.py: `tiny_dino()` with the choices measured there (batch 4, 1 encoder layer, 2 points,
    DDQ, NMS)."""
    config = tiny_dino()
    # More updates of fewer images each, in the same wall time: DETR-style set
    # prediction learns per update more than per image (configs/dino_tiny.py).
    config.global_batch_size = 4
    config.total_steps = 2160
    config.optimizer.warmup_steps = 270
    config.eval_every_steps = 720
    config.checkpoint_every_steps = 720
    # A cheaper step: one encoder layer, two sampling points per head and level.
    config.model.dino.encoder_layers = 1
    config.model.dino.num_points = 2
    config.model.dino.distinct_query_iou = 0.8
    config.postprocess.query_nms_iou_threshold = 0.7
    return config


def dino_r50_coco() -> ml_collections.ConfigDict:
    """configs/dino_r50_coco.py: DINO-4scale ResNet-50, 12 epochs on COCO 2017 (see that file)."""
    epoch_steps = 7_393  # 118,287 COCO train2017 images at global batch 16
    config = coco_2017(base_config())
    config.model.name = "dino"
    config.model.backbone = resnet_backbone((3, 4, 6, 3), 64, "bottleneck", norm="frozen_bn", freeze_stages=2)
    config.model.dino = dino_model()
    config.input.scale_jitter = (0.5, 1.25)

    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-4
    config.optimizer.weight_decay = 1e-4
    config.optimizer.grad_clip_norm = 0.1
    config.optimizer.lr_multipliers = (("backbone/.*", 0.1),)
    config.optimizer.schedule = "step"
    config.optimizer.warmup_steps = 0
    config.optimizer.decay_boundaries = (11 * epoch_steps,)

    config.postprocess.score_threshold = 0.0  # top-100 as DINO evaluates
    config.global_batch_size = 16
    config.eval_batch_size = 16
    config.total_steps = 12 * epoch_steps
    config.checkpoint_every_steps = 5_000
    return config
